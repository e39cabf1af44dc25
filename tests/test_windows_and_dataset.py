import json
import logging
import os

import numpy as np
import pytest
import torch
from conftest import read_barcode, write_with_opencv

from config import load_config
from datasets.keypoints import KeypointError, read_keypoints
from datasets.manifest import ManifestError, read_manifest
from datasets.sample import SAMPLE_KEYS
from datasets.video.info import VideoReadError
from datasets.video.probe import probe
from datasets.video_dataset import VideoWindowDataset, build_dataset
from datasets.windows import clip_indices, split_into_windows


def test_sample_windows_keep_the_stride_and_the_last_one_shrinks():
    assert split_into_windows(2500, 1000, 0) == [(0, 1000), (1000, 2000), (2000, 2500)]
    assert split_into_windows(2500, 1000, 100) == [(0, 1000), (900, 1900), (1800, 2500)]
    assert split_into_windows(1000, 1000, 0) == [(0, 1000)]
    assert split_into_windows(1001, 1000, 0) == [(0, 1000), (1000, 1001)]
    assert split_into_windows(700, None, 0) == [(0, 700)]
    assert split_into_windows(0, 10, 0) == []


def test_inference_chunks_align_the_last_one_to_the_end():
    assert split_into_windows(100, 32, 8, align_last_to_end=True) == [(0, 32), (24, 56), (48, 80), (68, 100)]
    assert split_into_windows(32, 32, 8, align_last_to_end=True) == [(0, 32)]
    assert split_into_windows(20, 32, 8, align_last_to_end=True) == [(0, 20)]
    assert split_into_windows(64, 32, 0, align_last_to_end=True) == [(0, 32), (32, 64)]


def test_clip_indices_random_centred_short_and_all():
    rng = np.random.default_rng(0)
    for _ in range(20):
        idx = clip_indices(100, 200, 16, 2, rng)
        assert len(idx) == 16 and idx[0] >= 100 and idx[-1] < 200 and set(np.diff(idx)) == {2}
    assert list(clip_indices(100, 200, 4, 10, None)) == [134, 144, 154, 164]  # span 31, centred: (100 - 31) // 2 = 34
    assert list(clip_indices(0, 5, 8, 1, None)) == [0, 0, 1, 1, 2, 3, 3, 4]  # too short: spread, repeats
    assert list(clip_indices(10, 20, -1, 3, None)) == [10, 13, 16, 19]


def write_manifest(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write(line if isinstance(line, str) else json.dumps(line))
            f.write("\n")
    return str(path)


@pytest.fixture
def long_video(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    write_with_opencv(str(root / "long.avi"), 250, "MJPG")
    kpt_dir = root / "kpt"
    kpt_dir.mkdir()
    for t in range(250):
        np.savez(kpt_dir / f"{t:06d}_long.npz", keypoints=np.full((2, 3), t, np.float32))
    return root


def data_cfg(**changes):
    cfg = load_config(
        None, ["data.num_workers=0", "data.load_kpt=true"] + [f"data.{k}={json.dumps(v)}" for k, v in changes.items()]
    )
    return cfg.data


def test_timeline_is_clipped_to_each_window_and_keypoints_align(long_video, caplog):
    manifest = write_manifest(
        long_video / "m.jsonl",
        [
            {
                "video": "long.avi",
                "keypoints": "kpt",
                "segments": [
                    {"start": 0, "end": 60, "label": "a"},
                    {"start": 60, "end": 180, "label": "b"},
                    {"start_sec": 7.2, "end_sec": 10.0, "label": "c"},
                ],
            }
        ],
    )
    cfg = data_cfg(max_video_frames=100, video_chunk_overlap=20, num_frames=-1, img_size=[48, 120])
    with caplog.at_level(logging.INFO, logger="longvideo"):
        dataset = VideoWindowDataset(read_manifest(manifest), ["a", "b", "c"], cfg, training=False)
    assert "sample windows: 1 videos -> 3 windows of at most 100 frames" in caplog.text
    assert [(w.start, w.end, w.label) for w in dataset.windows] == [(0, 100, 0), (80, 180, 1), (160, 250, 2)]
    assert dataset.windows[0].segments == [(0, 60, 0), (60, 100, 1)]
    assert dataset.windows[2].segments == [(160, 180, 1), (180, 250, 2)]  # 7.2 s at 25 fps = frame 180
    sample = dataset[2]
    assert sample["video"].shape == (3, 90, 48, 120) and sample["video"].dtype.is_floating_point is False
    assert [read_barcode(f) for f in sample["video"].permute(1, 2, 3, 0).numpy()[[0, 50, 89]]] == [160, 210, 249]
    assert sample["kpt"][:, 0, 0].tolist() == list(range(160, 250))  # keypoints of exactly the clip's frames
    assert sample["frame_labels"].tolist() == [1] * 20 + [2] * 70
    assert sample["window"].tolist() == [160, 250] and sample["video_index"] == 0
    assert set(sample) <= SAMPLE_KEYS  # every key the sample type declares


def test_training_clips_are_random_but_repeatable_per_epoch(long_video):
    manifest = write_manifest(long_video / "m.jsonl", [{"video": "long.avi", "label": "a", "keypoints": "kpt"}])
    cfg = data_cfg(num_frames=4, frame_stride=3)
    dataset = VideoWindowDataset(read_manifest(manifest), ["a"], cfg, training=True, seed=1)
    first = dataset[0]["frame_indices"].tolist()
    assert dataset[0]["frame_indices"].tolist() == first
    dataset.set_epoch(1)
    assert dataset[0]["frame_indices"].tolist() != first


def test_bad_manifest_lines_name_the_file_and_line(tmp_path):
    cases = [
        ('{"video": "a.mp4"', "not valid JSON"),
        ('{"label": "x"}', "give exactly one of 'video' (one file) or 'views' ({name: file})"),
        ('{"video": "a.mp4"}', "missing 'label' (or 'segments')"),
        (
            '{"video": "a.mp4", "segments": [{"start": 10, "end": 5, "label": "x"}]}',
            "segments[0]: needs 0 <= start < end, got 10, 5",
        ),
        ('{"video": 3, "label": "x"}', "'video' must be a path (a non-empty string), got 3"),
    ]
    for text, expected in cases:
        path = write_manifest(tmp_path / "m.jsonl", ['{"video": "ok.mp4", "label": "x"}', text])
        with pytest.raises(ManifestError) as info:
            read_manifest(path)
        assert str(info.value).startswith(f"{path}:2: ") and expected in str(info.value)


def test_bad_videos_raise_with_the_manifest_line_or_are_skipped(tmp_path, long_video, caplog):
    (tmp_path / "empty.mp4").write_bytes(b"")
    good = str(long_video / "long.avi")
    manifest = write_manifest(
        tmp_path / "m.jsonl",
        [{"video": good, "label": "a"}, {"video": "empty.mp4", "label": "a"}, {"video": "gone.mp4", "label": "a"}],
    )
    with pytest.raises(VideoReadError) as info:
        VideoWindowDataset(read_manifest(manifest), ["a"], data_cfg(load_kpt=False), training=False)
    assert str(info.value) == f"{tmp_path}/empty.mp4: empty file (0 bytes) (sample at {manifest}:2)"
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        dataset = VideoWindowDataset(
            read_manifest(manifest), ["a"], data_cfg(load_kpt=False, on_bad_video="skip"), training=False
        )
    # files, not manifest lines, each with its reason and line
    assert len(dataset) == 1 and sorted(dataset.skipped) == [f"{tmp_path}/empty.mp4", f"{tmp_path}/gone.mp4"]
    assert dataset.skipped[f"{tmp_path}/gone.mp4"].endswith(f"(sample at {manifest}:3)")
    assert "file not found" in caplog.text


def test_segments_outside_the_video_and_unknown_labels(long_video):
    manifest = write_manifest(
        long_video / "m.jsonl",
        [
            {
                "video": "long.avi",
                "segments": [{"start": 0, "end": 100, "label": "a"}, {"start": 300, "end": 400, "label": "a"}],
            }
        ],
    )
    with pytest.raises(
        ManifestError, match=r"m\.jsonl:1: segment \[300, 400\) 'a' starts after the video's 250 frames"
    ):
        VideoWindowDataset(read_manifest(manifest), ["a"], data_cfg(load_kpt=False), training=False)
    manifest = write_manifest(long_video / "n.jsonl", [{"video": "long.avi", "label": "zebra"}])
    with pytest.raises(ManifestError, match=r"n\.jsonl:1: label 'zebra' is not a known class \(a\)"):
        VideoWindowDataset(read_manifest(manifest), ["a"], data_cfg(load_kpt=False), training=False)


def test_missing_keypoint_frames_are_named(long_video):
    os.rename(long_video / "kpt" / "000007_long.npz", long_video / "kpt" / "moved.npz")
    try:
        with pytest.raises(KeypointError, match=r"kpt: keypoint files missing for frames \[7\]"):
            read_keypoints(str(long_video / "kpt"), [6, 7, 8])
    finally:
        os.rename(long_video / "kpt" / "moved.npz", long_video / "kpt" / "000007_long.npz")


def test_csv_and_folder_manifests(tmp_path, long_video):
    (tmp_path / "m.csv").write_text(f"video,label\n{long_video / 'long.avi'},a\n")
    assert [r.label for r in read_manifest(str(tmp_path / "m.csv"))] == ["a"]
    (tmp_path / "root" / "jump").mkdir(parents=True)
    (tmp_path / "root" / "jump" / "x.mp4").write_bytes(b"")
    records = read_manifest(str(tmp_path / "root"))
    assert [(r.label, os.path.basename(r.first_path)) for r in records] == [("jump", "x.mp4")]


def test_multiview_samples_read_every_view_at_the_same_frames(synthetic_root, tiny_cfg):
    tiny_cfg.data.train_manifest = "multiview_train.jsonl"
    dataset = build_dataset(tiny_cfg, "train", ["down", "grow", "left", "right", "shrink", "up"], training=True)
    sample = dataset[0]
    assert dataset.view_names == ["front", "left", "right"]
    assert sample["video"].shape == (3, 3, 8, 32, 32)  # [V, C, T, H, W]


def test_the_pyav_decoder_loads_the_same_samples(synthetic_root, tiny_cfg):
    names = ["down", "grow", "left", "right", "shrink", "up"]
    tiny_cfg.data.train_manifest = "multiview_train.jsonl"
    by_opencv = build_dataset(tiny_cfg, "train", names, training=True)
    tiny_cfg.data.decoder = "pyav"
    by_pyav = build_dataset(tiny_cfg, "train", names, training=True)
    for index in (0, len(by_pyav) - 1, 2):
        a, b = by_opencv[index], by_pyav[index]
        assert a["frame_indices"].tolist() == b["frame_indices"].tolist()
        assert torch.equal(a["video"], b["video"])


def test_windows_past_the_real_end_of_a_short_video_shrink_or_fail_clearly(tmp_path, caplog):
    path = write_with_opencv(str(tmp_path / "cut.avi"), 200, "MJPG")
    data = open(path, "rb").read()
    manifest = write_manifest(tmp_path / "m.jsonl", [{"video": "cut.avi", "label": "a"}])
    cfg = data_cfg(load_kpt=False, max_video_frames=80, num_frames=-1, img_size=[48, 120])
    dataset = VideoWindowDataset(read_manifest(manifest), ["a"], cfg, training=False)
    assert [(w.start, w.end) for w in dataset.windows] == [(0, 80), (80, 160), (160, 200)]
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])  # cut after indexing: the header still says 200 frames
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        second = dataset[1]
    real = int(second["frame_indices"][-1]) + 1
    assert 80 < real < 160 and second["video"].shape[1] == real - 80  # shrunk to the frames that exist
    assert "decoding ends at frame" in caplog.text and "cut.avi" in caplog.text
    with pytest.raises(
        VideoReadError,
        match=r"cut\.avi: the video ends at frame \d+, before this sample window "
        r"\[160, 200\) \(sample at .*m\.jsonl:1\)",
    ):
        dataset[2]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="longvideo"):  # indexed now: its whole frames, said once
        again = VideoWindowDataset(read_manifest(manifest), ["a"], cfg, training=False)
    whole = probe(path).num_frames
    assert [(w.start, w.end) for w in again.windows] == [(0, 80), (80, whole)] and whole < real
    assert f"cut.avi: the header says 200 frames but the file holds {whole} (cut short" in caplog.text


def test_a_sample_that_fails_while_loading_is_replaced_when_skipping(tmp_path, long_video, monkeypatch):
    manifest = write_manifest(
        tmp_path / "m.jsonl",
        [{"video": str(long_video / "long.avi"), "label": "a"}, {"video": str(long_video / "long.avi"), "label": "b"}],
    )
    dataset = VideoWindowDataset(
        read_manifest(manifest), ["a", "b"], data_cfg(load_kpt=False, on_bad_video="skip"), training=False
    )
    real_load = dataset._load

    def flaky(index):
        if index == 0:
            raise VideoReadError("long.avi: decoding failed half-way")
        return real_load(index)

    monkeypatch.setattr(dataset, "_load", flaky)
    sample = dataset[0]
    # the file and its reason, for the main process to report once per run
    assert sample["label"] == 1 and sample["skipped"] == {
        str(long_video / "long.avi"): f"long.avi: decoding failed half-way (sample at {manifest}:1)"
    }
