"""The ``data`` section of the configuration schema (config/schema.py holds the others and ``Config``): manifests,
decoding, sample windows, clips, geometry and augmentation, and the DataLoader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from config.keys import choice, setting


@dataclass
class DataConfig:
    """data: manifests, decoding, sample windows, clips, geometry and augmentation, and the DataLoader."""

    data_dir: str = setting("data/synthetic", "str", "directory the manifests are resolved against")
    val_fraction: float | None = setting(
        None,
        "float",
        "split this share of the training videos off as validation (by "
        "a hash of each video's path, or of its data.group_key: the same split every run), instead of "
        "data.val_manifest",
        minimum=0.0,
        maximum=1.0,
        nullable=True,
    )
    group_key: str | None = setting(
        None,
        "str",
        "a manifest field (patient, subject, session) whose videos stay on one side of a split: data.val_fraction "
        "and python -m engine.evaluation.k_fold split by its values; set it when videos of one group look alike",
        nullable=True,
    )
    balance: Literal["none", "videos", "classes"] = choice(
        "none",
        "what a training epoch draws: none (each sample window once, so a long video weighs as many windows as it "
        "has), videos (each video alike, however many windows it has) or classes (each class alike, each of its "
        "videos alike): windows drawn with replacement, as many as the training set has; set it when the "
        "videos' lengths or the classes' sizes differ much",
    )
    train_manifest: str = setting("train.jsonl", "str", "training manifest (JSONL, CSV or a root/<class>/ folder)")
    val_manifest: str | None = setting("val.jsonl", "str", "validation manifest", nullable=True)
    test_manifest: str | None = setting("test.jsonl", "str", "test manifest", nullable=True)
    class_names: list | None = setting(
        None, "list", "class names in label order; null = sorted training labels", nullable=True
    )
    features_dir: str | None = setting(
        None,
        "str",
        "train the temporal head on the features files infer_chunked.py "
        "--features wrote here (one sample: one whole video; labels and segments from "
        "the manifests), instead of on video clips",
        nullable=True,
    )
    features_format: Literal["npz", "mstcn"] = choice(
        "npz",
        "npz: data.features_dir holds infer_chunked.py --features files, labels from the manifests; mstcn: it "
        "is a dataset root in MS-TCN's layout (features/*.npy [D, T], groundTruth/*.txt, mapping.txt, "
        "splits/*.bundle: Breakfast, 50Salads, GTEA), read in place, data.frame_stride its sample_rate",
    )
    features_split: int = setting(
        1,
        "int",
        "features_format: mstcn: the cross-validation split N: splits/train.splitN.bundle trains, "
        "test.splitN.bundle validates",
        minimum=1,
    )
    background_labels: list = setting(
        [],
        "list",
        "labels left out of the segments the timeline scores count (edit, "
        "F1@k), as the field's bg_class; frame accuracy counts every frame",
    )
    batch_size: int | str = setting(
        8,
        "int",
        "clips per training micro-batch; auto = the largest whose estimated "
        "memory fits trainer.memory_budget_gb (train.py --probe-memory shows the "
        "estimates)",
        minimum=1,
        also=("auto",),
    )
    num_workers: int = setting(2, "int", "DataLoader worker processes", minimum=0)
    img_size: list[int] = setting(
        112, "size", "the model's frame size, after resize and crop: N (square) or [height, width]"
    )
    resize: Literal["short_side", "stretch"] = choice(
        "short_side",
        "short_side: keep the aspect ratio (short side to data.short_side), "
        "then crop to img_size; stretch: decode straight to img_size",
    )
    short_side: int | None = setting(
        None,
        "int",
        "decoded short side (resize: short_side); null = the least that holds the img_size crop",
        minimum=1,
        nullable=True,
    )
    test_clips: int = setting(
        1,
        "int",
        "temporal clips per sample window at evaluation, evenly spaced (first at the "
        "window's start, last at its end; 1: centred), each times data.test_crops; the "
        "video-level result averages them all",
        minimum=1,
    )
    test_crops: int = setting(
        1,
        "int",
        "spatial crops per clip at evaluation: 1 (centre) or 3 (along the long side)",
        minimum=1,
        maximum=3,
        refused=((2, "use 1 (the centre) or 3 (start, centre, end of the long side)"),),
    )
    augment: bool = setting(
        False, "bool", "training augmentation: random resized crop, flip, colour jitter (never at evaluation)"
    )
    flip: bool = setting(
        True,
        "bool",
        "augment: horizontal flip with probability 0.5 (it turns a movement to the right into one to the left: a label "
        "that names a side or a direction needs data.flip_label_pairs, or false)",
    )
    color_jitter: float = setting(
        0.0,
        "float",
        "augment: brightness, contrast and saturation factors in [1-s, 1+s]; 0 = off",
        minimum=0.0,
        maximum=1.0,
    )
    flip_label_pairs: list | None = setting(
        None,
        "list",
        "augment: classes that swap when a clip is flipped, [[swipe_left, swipe_right], ...]",
        nullable=True,
    )
    kpt_coords: Literal["normalized", "pixels"] = choice(
        "normalized",
        "keypoint x, y: normalized (0..1 of the frame) or pixels (of the stored frame)",
    )
    kpt_flip_pairs: list | None = setting(
        None,
        "list",
        "augment + flip + keypoints: joint indices that swap in a flip, [[5, 6], ...]; [] if no joint has a side",
        nullable=True,
    )
    num_frames: int = setting(
        16, "int", "frames per clip; -1 = every frame of the sample window", minimum=1, also=(-1,)
    )
    frame_stride: int = setting(1, "int", "distance between the decoded frames of a clip", minimum=1)
    load_rgb: bool = setting(True, "bool", "decode video frames")
    load_kpt: bool = setting(False, "bool", "load per-frame keypoints")
    fps: float | None = setting(
        None,
        "float",
        "sample clips and inference chunks at about this many frames a second of video: each video's stride is "
        "its own frame rate (read from the file) over this, rounded, so recordings at 25 and 60 fps cover the same "
        "time; null: every data.frame_stride-th frame. The temporal head places chunks by clip frame, at this rate",
        minimum=0.001,
        nullable=True,
    )
    max_video_frames: int | None = setting(
        None,
        "int",
        "split videos into sample windows of at most this many frames; null = whole videos",
        minimum=1,
        nullable=True,
    )
    sample_window_overlap: int = setting(0, "int", "frames shared by consecutive sample windows", minimum=0)
    decoder: Literal["auto", "opencv", "pyav"] = choice(
        "auto",
        "video decoder: auto (the faster exact one for each codec and access "
        "pattern, measured by bench/loader.py), opencv, or pyav (same frames and pixels; also "
        "reads AV1)",
    )
    on_bad_video: Literal["raise", "skip"] = choice(
        "raise",
        "a video that cannot be read: stop, or log it and use another sample",
    )
    sample_timeout_s: float | None = setting(
        300.0,
        "float",
        "seconds one sample (or a file's header at indexing, or a "
        "group of inference chunks) may take to load before it counts as a bad "
        "video (a stalled mount); null = no deadline",
        minimum=0.001,
        nullable=True,
    )
    prepared_dir: str | None = setting(
        None,
        "str",
        "folder of prepared copies (python -m datasets.prepare): each video re-encoded at this config's decode "
        "size with short GOPs, read instead of its source when its copy matches the source and these settings; "
        "null = read the sources",
        nullable=True,
    )
    mean: list | None = setting(
        None,
        "list",
        "per-channel mean (RGB, 0..1) for normalization on the device; null: the named weights' own "
        "(model.pretrained: kinetics400, or true for a torchvision video backbone), else 0.45 each",
        nullable=True,
    )
    std: list | None = setting(
        None, "list", "per-channel std (RGB, 0..1); null: the named weights' own, else 0.225 each", nullable=True
    )
