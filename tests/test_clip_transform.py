"""Aspect-true geometry, crops and augmentation (datasets/clip_transform.py): exact boxes, keypoints that stay on
their pixel, one set of random parameters per clip, exact resume."""

import dataclasses
import os

import cv2
import numpy as np
import pytest
import torch
from conftest import decode_sequentially, overrides
from torchvision.transforms.v2 import functional as F

import train
from artifacts.checkpoint import load_checkpoint
from config import ConfigError, load_config
from datasets.clip_transform import (
    Box,
    ClipTransform,
    ViewGeometry,
    crop,
    decode_size,
    evaluation_boxes,
    random_resized_box,
    resize,
    transform_keypoints,
)
from datasets.manifest import VideoRecord
from datasets.video.choice import open_reader
from datasets.video.frame_reader import resize_frame
from datasets.video_dataset import VideoWindowDataset

SHARED_CLIP = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "nasa_13013.mp4"
)


def data_cfg(*overrides_):
    return load_config(None, list(overrides_)).data


def test_decode_size_keeps_the_aspect_ratio_and_holds_the_crop():
    # 640x360 with a 112 crop: the short side becomes 112 (not 112x112: 2.3x less distortion than stretching)
    assert decode_size(360, 640, data_cfg("data.img_size=112")) == (112, 199)
    assert decode_size(360, 640, data_cfg("data.img_size=112", "data.short_side=128")) == (128, 228)
    assert decode_size(360, 640, data_cfg("data.img_size=112", "data.resize=stretch")) == (112, 112)
    # a portrait video with the rtx5080 guide's 160x210 crop: the width must hold 210
    assert decode_size(640, 360, data_cfg("data.img_size=[160, 210]")) == (373, 210)
    # a short_side too small to hold the crop is raised to the least that does
    assert decode_size(360, 640, data_cfg("data.img_size=112", "data.short_side=64")) == (112, 199)


def test_evaluation_crops_are_the_centre_or_three_along_the_long_side():
    assert evaluation_boxes((128, 228), (112, 112), 1) == [Box(8, 58, 112, 112)]
    assert evaluation_boxes((128, 228), (112, 112), 3) == [
        Box(8, 0, 112, 112),
        Box(8, 58, 112, 112),
        Box(8, 116, 112, 112),
    ]
    assert evaluation_boxes((373, 210), (160, 210), 3) == [
        Box(0, 0, 160, 210),
        Box(106, 0, 160, 210),
        Box(213, 0, 160, 210),
    ]
    assert evaluation_boxes((112, 112), (112, 112), 3) == [Box(0, 0, 112, 112)] * 3


def test_random_resized_boxes_stay_inside_with_the_asked_area_and_ratio():
    rng = np.random.default_rng(0)
    for _ in range(200):
        box = random_resized_box((128, 228), (160, 210), (0.35, 1.0), (0.75, 1.3333), rng)
        assert 0 <= box.top and box.top + box.height <= 128 and 0 <= box.left and box.left + box.width <= 228
        aspect = (box.width / box.height) / (210 / 160)
        assert 0.75 - 0.05 <= aspect <= 1.3333 + 0.05 or (box.height == 128 or box.width == 228)  # or the fallback


def blob_frame(height, width, x, y, radius=6):
    """A black frame with a white disc centred on pixel (x, y)."""
    frame = np.zeros((height, width, 3), np.uint8)
    cv2.circle(frame, (x, y), radius, (255, 255, 255), -1)
    return frame


def centroid(image: np.ndarray) -> tuple[float, float]:
    weight = image.astype(np.float64)
    ys, xs = np.mgrid[: image.shape[0], : image.shape[1]]
    return float((xs * weight).sum() / weight.sum()), float((ys * weight).sum() / weight.sum())


@pytest.mark.parametrize("coords", ["pixels", "normalized"])
@pytest.mark.parametrize("seed", range(6))
def test_a_keypoint_stays_on_the_pixel_it_marks(coords, seed):
    """A disc at a known pixel of a 640x360 frame, through decode resize, random resized crop and flip: the
    transformed keypoint lands on the disc's centre in the output (within 0.35 output pixels)."""
    rng = np.random.default_rng(seed)
    x, y = int(rng.integers(200, 440)), int(rng.integers(120, 240))
    frame = blob_frame(360, 640, x, y)
    cfg = data_cfg(
        "data.img_size=[96, 128]",
        "data.augment=true",
        f"data.kpt_coords={coords}",
        "data.short_side=120",
    )
    transform = ClipTransform(cfg, training=True)
    [plan] = transform.plan([(360, 640)], rng)
    decoded = resize_frame(frame, *plan.decoded)  # what the reader does while decoding
    video = torch.from_numpy(np.stack([decoded, decoded])).permute(0, 3, 1, 2)
    out = transform.frames(video, plan)[0, 0].numpy()
    kpt = (
        np.array([[[x, y, 1.0]]], np.float32)
        if coords == "pixels"
        else np.array([[[(x + 0.5) / 640, (y + 0.5) / 360, 1.0]]], np.float32)
    )
    moved = transform.keypoints(kpt, plan)[0, 0]
    got = centroid(out)
    if coords == "normalized":
        got = ((got[0] + 0.5) / 128, (got[1] + 0.5) / 96)
        np.testing.assert_allclose(moved[:2], got, atol=0.35 / 96)
    else:
        np.testing.assert_allclose(moved[:2], got, atol=0.35)
    assert moved[2] == 1.0  # the confidence is not geometry


def test_a_flip_mirrors_x_and_swaps_the_paired_joints():
    geometry = ViewGeometry((100, 200), (100, 200), Box(0, 0, 100, 200), (100, 200), flipped=True)
    kpt = np.array([[[10.0, 5.0, 1.0], [150.0, 50.0, 0.5], [np.nan, np.nan, 0.0]]], np.float32)
    moved = transform_keypoints(kpt, geometry, "pixels", joint_swap=[(0, 1)])
    np.testing.assert_array_equal(moved[0, 0], [199 - 150.0, 50.0, 0.5])  # joint 1's point, mirrored, now joint 0
    np.testing.assert_array_equal(moved[0, 1], [199 - 10.0, 5.0, 1.0])
    assert np.isnan(moved[0, 2, :2]).all()  # missing stays missing
    normalized = transform_keypoints(np.array([[[0.25, 0.5, 1.0]]], np.float32), geometry, "normalized")
    np.testing.assert_allclose(normalized[0, 0], [0.75, 0.5, 1.0])


def test_every_frame_of_a_clip_gets_the_same_random_parameters():
    cfg = data_cfg("data.img_size=48", "data.augment=true", "data.color_jitter=0.4")
    transform = ClipTransform(cfg, training=True)
    frame = np.random.default_rng(0).integers(0, 256, (90, 160, 3), dtype=np.uint8)
    for seed in range(5):
        rng = np.random.default_rng(seed)
        [plan] = transform.plan([(90, 160)], rng)
        decoded = resize_frame(frame, *plan.decoded)
        video = torch.from_numpy(np.stack([decoded] * 8)).permute(0, 3, 1, 2)
        out = transform.frames(video, plan, transform.colour_factors(rng))
        assert out.shape == (8, 3, 48, 48) and out.dtype == torch.uint8
        assert all(torch.equal(out[0], out[t]) for t in range(8))


def test_evaluation_has_no_randomness_and_three_crops_are_three_samples(synthetic_root):
    cfg = load_config(
        None,
        [
            f"data.data_dir={synthetic_root}",
            "data.img_size=24",
            "data.num_frames=4",
            "data.augment=true",
            "data.color_jitter=0.5",
            "data.test_crops=3",
        ],
    ).data
    from datasets.manifest import read_manifest

    records = read_manifest(os.path.join(synthetic_root, "val.jsonl"))
    names = ["down", "grow", "left", "right", "shrink", "up"]
    evaluation = VideoWindowDataset(records, names, cfg, training=False)
    assert len(evaluation) == 3 * len(evaluation.windows)
    first, again = evaluation[1], evaluation[1]
    assert torch.equal(first["video"], again["video"])
    # the synthetic frames are 32x32: decoded at 24x24, the three crops coincide with the centre
    assert torch.equal(evaluation[0]["video"], evaluation[1]["video"])


def test_a_flipped_clip_swaps_its_label_pair(synthetic_root, monkeypatch):
    from datasets import clip_transform

    # the random resized crop kept to the whole frame: a flipped clip is exactly the mirror of the plain one
    monkeypatch.setattr(clip_transform, "CROP_SCALE", (1.0, 1.0))
    monkeypatch.setattr(clip_transform, "CROP_RATIO", (1.0, 1.0))
    cfg = load_config(
        None,
        [
            f"data.data_dir={synthetic_root}",
            "data.img_size=32",
            "data.num_frames=4",
            "data.augment=true",
            "data.flip_label_pairs=[[left, right]]",
        ],
    ).data
    names = ["down", "grow", "left", "right", "shrink", "up"]
    from datasets.manifest import read_manifest

    records = [r for r in read_manifest(os.path.join(synthetic_root, "train.jsonl")) if r.label == "left"]
    plain = VideoWindowDataset(records, names, dataclasses.replace(cfg, augment=False), training=True)
    augmented = VideoWindowDataset(records, names, cfg, training=True)
    labels = []
    for index in range(len(augmented)):
        sample, reference = augmented[index], plain[index]
        mirrored = torch.equal(sample["video"], reference["video"].flip(-1))
        assert mirrored or torch.equal(sample["video"], reference["video"])
        assert sample["label"] == names.index("right" if mirrored else "left")
        labels.append(sample["label"])
    assert set(labels) == {names.index("left"), names.index("right")}  # both happened


def test_augmentation_config_errors_say_what_to_set():
    with pytest.raises(
        ConfigError,
        match=r"a horizontal flip must swap left and right joints of the keypoints: set "
        r"data.kpt_flip_pairs .*, or data.flip: false",
    ):
        load_config(None, ["data.augment=true", "data.load_kpt=true"])
    load_config(None, ["data.augment=true", "data.load_kpt=true", "data.kpt_flip_pairs=[]"])
    with pytest.raises(ConfigError, match=r"data.test_crops: use 1 \(the centre\) or 3"):
        load_config(None, ["data.test_crops=2"])
    with pytest.raises(ConfigError, match=r"data.flip_label_pairs names sideways, not in data.class_names"):
        load_config(None, ["data.class_names=[a, b]", "data.flip_label_pairs=[[a, sideways]]"])


def test_resume_is_exact_with_augmentation_on(synthetic_root, tmp_path):
    extra = [
        "data.augment=true",
        "data.color_jitter=0.3",
        "data.flip_label_pairs=[[left, right]]",
        "data.short_side=36",
        "data.num_workers=1",
    ]
    assert train.main(overrides(synthetic_root, tmp_path / "whole", *extra)) == 0
    reference = load_checkpoint(os.path.join(tmp_path, "whole", "e2e", "latest", "checkpoints", "last.pt"))
    args = overrides(synthetic_root, tmp_path / "halves", *extra)
    assert train.main(args + ["--stop-after-steps", "7"]) == 0  # in the middle of epoch 2
    assert train.main(args + ["--resume", "auto"]) == 0
    resumed = load_checkpoint(os.path.join(tmp_path, "halves", "e2e", "latest", "checkpoints", "last.pt"))
    assert resumed.state.global_step == reference.state.global_step == 10
    for key, value in reference.model.items():
        torch.testing.assert_close(resumed.model[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.skipif(not os.path.exists(SHARED_CLIP), reason="../shared/data/nasa_13013.mp4 is not there")
@pytest.mark.parametrize("decoder", ["opencv", "pyav"])
def test_real_footage_is_decoded_aspect_true_and_centre_cropped(decoder):
    """The real 320x180 camera clip through the evaluation geometry (img_size 64, short side 72): each frame is the
    sequentially decoded frame, resized to 72x128 and centre-cropped, pixel for pixel."""
    cfg = data_cfg(
        "data.img_size=64",
        "data.short_side=72",
        "data.num_frames=6",
        "data.frame_stride=50",
        f"data.decoder={decoder}",
    )
    dataset = VideoWindowDataset(
        [VideoRecord({"video": SHARED_CLIP}, label="a", where="clip")], ["a"], cfg, training=False
    )
    sample = dataset[0]
    indices = sample["frame_indices"].tolist()
    sequential = decode_sequentially(SHARED_CLIP, rgb=False)
    assert decode_size(180, 320, cfg) == (72, 128)
    for t, index in enumerate(indices):
        expected = cv2.cvtColor(resize_frame(sequential[index], 72, 128), cv2.COLOR_BGR2RGB)[4:68, 32:96]
        np.testing.assert_array_equal(sample["video"][:, t].permute(1, 2, 0).numpy(), expected)
    reader = open_reader(SHARED_CLIP, (72, 128), decoder=decoder)
    np.testing.assert_array_equal(reader.read(indices)[:, 4:68, 32:96], sample["video"].permute(1, 2, 3, 0).numpy())


def test_flip_pairs_must_name_classes_and_joints_of_the_data(synthetic_root):
    from datasets.manifest import ManifestError, read_manifest

    records = read_manifest(os.path.join(synthetic_root, "train.jsonl"))
    names = ["down", "grow", "left", "right", "shrink", "up"]
    cfg = load_config(
        None,
        [f"data.data_dir={synthetic_root}", "data.augment=true", "data.load_kpt=true", "data.kpt_flip_pairs=[[0, 9]]"],
    ).data
    with pytest.raises(
        ManifestError,
        match=r"^data.kpt_flip_pairs names joint 9, but the keypoints have 5 joints "
        r"\(0 to 4\)$",
    ):
        VideoWindowDataset(records, names, cfg, training=True)
    with pytest.raises(ManifestError, match=r"^data.flip_label_pairs names sideways, not a class of the data"):
        VideoWindowDataset(
            records,
            names,
            dataclasses.replace(cfg, kpt_flip_pairs=[], flip_label_pairs=[["left", "sideways"]]),
            training=True,
        )


def test_each_view_gets_its_own_crop_but_the_sample_one_flip():
    transform = ClipTransform(data_cfg("data.img_size=64", "data.augment=true"), training=True)
    flips = set()
    for seed in range(20):
        plans = transform.plan([(360, 640), (360, 640), (480, 640)], np.random.default_rng(seed))
        assert len({p.flipped for p in plans}) == 1  # one flip for the sample
        assert len({p.box for p in plans}) == 3  # three cameras, three crops
        assert plans[2].decoded == decode_size(480, 640, transform.cfg)  # each view at its own aspect ratio
        flips.add(plans[0].flipped)
    assert flips == {True, False}


def test_the_crop_and_resize_give_torchvisions_pixels():
    """The crop, resize and flip run in torch's own calls (a process that does not jitter colours never imports
    torchvision): the same pixels as torchvision.transforms.v2's, uint8 and float, up and down, boxes partly outside
    the frame (black there), on whichever kernel this CPU has."""
    generator = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (5, 3, 47, 61), dtype=torch.uint8, generator=generator)
    cases = [  # box (top, left, height, width), output size
        ((3, 7, 30, 40), (16, 20)),
        ((0, 0, 47, 61), (64, 96)),
        ((10, 12, 20, 20), (20, 20)),
        ((-4, 50, 30, 20), (12, 8)),
        ((40, -3, 12, 70), (6, 35)),
    ]
    for dtype in (torch.uint8, torch.float32, torch.float16):
        clip = video.to(dtype)
        for (top, left, height, width), size in cases:
            ours = resize(crop(clip, Box(top, left, height, width)), size).flip(-1)
            theirs = F.horizontal_flip(F.resized_crop(clip, top, left, height, width, list(size), antialias=True))
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (dtype, top, left, size)
