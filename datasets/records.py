"""A run's manifests: which file each split reads, the training/validation split, the class names, and the checks of
a line's labels and segments shared by training, evaluation and streaming inference."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

import numpy as np

from config import DataConfig
from core.errors import UsageError
from datasets.manifest import VIDEO_EXTENSIONS, ManifestError, VideoRecord, read_manifest

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger


def check_labels(record: VideoRecord, class_names: list[str], unlabelled_ok: bool = False) -> None:
    """Every label of a manifest line (its label, its segments') is a known class; shared by training,
    evaluation and infer_chunked.py (where a line may have no label: ``unlabelled_ok``), so they refuse the
    same lines with the same message."""
    for label in record.labels():
        if label is None and unlabelled_ok:
            continue
        if label not in class_names:
            raise ManifestError(f"{record.where}: label '{label}' is not a known class ({', '.join(class_names)})")


def segment_frames(record: VideoRecord, length: int, fps: float, class_names: list[str]) -> list[tuple]:
    """A line's segments as (start, end, class index) frames, cut at the video's ``length``; a segment that
    starts after the video's end is an error."""
    timeline = []
    for seg in record.segments:
        start, end = seg.in_frames(fps)
        if start >= length:
            raise ManifestError(
                f"{record.where}: segment [{start}, {end}) '{seg.label}' starts after the video's {length} frames"
            )
        timeline.append((start, min(end, length), class_names.index(seg.label)))
    return timeline


def frame_labels(segments: list[tuple] | None, indices: np.ndarray, label: int = -1) -> np.ndarray:
    """The class of each frame at ``indices``: the (start, end, class index) segment covering it (``segment_frames``'
    form), -1 where none does; without segments, ``label`` for every frame (a line labelled as a whole). Shared by
    the clips of training and evaluation, the features of whole videos and streaming inference's timelines."""
    if not segments:
        return np.full(len(indices), label, dtype=np.int64)
    labels = np.full(len(indices), -1, dtype=np.int64)
    for start, end, index in segments:
        labels[(indices >= start) & (indices < end)] = index
    return labels


def label_runs(labels: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, label) of each run of equal per-frame labels, end exclusive: ``frame_labels`` read back."""
    labels = np.asarray(labels)
    if len(labels) == 0:
        return []
    cuts = np.flatnonzero(np.diff(labels)) + 1
    return [(int(s), int(e), int(labels[s])) for s, e in zip(np.r_[0, cuts], np.r_[cuts, len(labels)])]


def unlabelled(records: list[VideoRecord], label: str) -> list[VideoRecord]:
    """Records as a run that reads no label takes them (train.objective: motion): every one ``label``, no
    timeline; a manifest of videos alone then loads as one with labels."""
    return [dataclasses.replace(r, label=label, segments=None) for r in records]


def manifest_path(data_cfg: DataConfig, split: str) -> str | None:
    name = {"train": data_cfg.train_manifest, "val": data_cfg.val_manifest, "test": data_cfg.test_manifest}[split]
    if name is None:
        return None
    return name if os.path.isabs(name) else os.path.join(data_cfg.data_dir, name)


def resolve_class_names(data_cfg: DataConfig, train_records) -> list[str]:
    if data_cfg.class_names is not None:
        return [str(n) for n in data_cfg.class_names]
    return sorted({label for r in train_records for label in r.labels()})


DATA_LAYOUTS = (
    'a JSONL manifest ({"video": "videos/a.mp4", "label": "left"} a line), a CSV with video,label '
    "columns, or a folder root/<class>/<video>"
)


def read_split(data_cfg: DataConfig, split: str, labelled: bool = True) -> list[VideoRecord]:
    """The manifest of ``data.<split>_manifest``; a missing one names the key and the accepted forms. ``labelled``
    False: its lines may have no label (``read_manifest``)."""
    path = manifest_path(data_cfg, split)
    if path is None:
        raise ManifestError(f"data.{split}_manifest is null; set it to {DATA_LAYOUTS}")
    if not os.path.exists(path):
        raise ManifestError(
            f"{path}: not found (data.{split}_manifest, resolved against data.data_dir="
            f"{data_cfg.data_dir}); give {DATA_LAYOUTS}"
        )
    return read_manifest(path, labelled)


def training_records(data_cfg: DataConfig, labelled: bool = True) -> tuple[list[VideoRecord], list[VideoRecord] | None]:
    """(training, validation) records: the two manifests, or one split by ``data.val_fraction``."""
    records = read_split(data_cfg, "train", labelled)
    fraction = data_cfg.val_fraction
    if fraction:
        chosen = [_in_validation(split_key(r, data_cfg), fraction) for r in records]
        train = [r for r, v in zip(records, chosen) if not v]
        val = [r for r, v in zip(records, chosen) if v]
        if not train or not val:
            raise ManifestError(
                f"data.val_fraction={fraction:g} leaves {len(train)} training and {len(val)} "
                f"validation videos of {len(records)}; choose a fraction that leaves both"
            )
        log.info(
            "data.val_fraction=%g: %d videos for training, %d for validation (split by %s, the same every run)",
            fraction,
            len(train),
            len(val),
            data_cfg.group_key or "path",
        )
        return train, val
    if data_cfg.val_manifest is None:
        return records, None
    train_path, val_path = manifest_path(data_cfg, "train"), manifest_path(data_cfg, "val")
    if os.path.realpath(train_path) == os.path.realpath(val_path):
        log.warning(
            "data.val_manifest and data.train_manifest are the same data (%s): validation measures the "
            "training set; set data.val_fraction: 0.1 (a split by video) or give a separate manifest",
            train_path,
        )
    return records, read_split(data_cfg, "val", labelled)


def split_key(record: VideoRecord, data_cfg: DataConfig) -> str:
    """What keeps videos together in a split: the value of the record's data.group_key field, else its path
    relative to data.data_dir (the same on every machine)."""
    key = data_cfg.group_key
    if key is None:
        return os.path.relpath(record.first_path, data_cfg.data_dir)
    if key not in record.extra or record.extra[key] in (None, ""):
        raise ManifestError(
            f"{record.where}: no '{key}' (data.group_key: {key}); give every video its {key}, or set "
            f"data.group_key: null"
        )
    return str(record.extra[key])


def _in_validation(key: str, fraction: float) -> bool:
    """Whether a video (by its ``split_key``) goes to validation: a hash of the key, so the split is the same on
    every run and machine, and a video's windows (a group's videos) never land on both sides."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 2**32 < fraction


def resolve_inputs(input_arg: str | None, data_cfg: DataConfig) -> tuple[str, list[VideoRecord]]:
    """infer_chunked.py --input: a video, a folder of videos (or of class folders), a manifest; without one, the
    config's test or val manifest. (what it names, the records)"""
    if input_arg is None:
        for split in ("test", "val"):
            path = manifest_path(data_cfg, split)
            if path and os.path.exists(path):
                return path, read_manifest(path)
        raise UsageError("no --input given and the checkpoint's config has no test or val manifest on this machine")
    if os.path.isdir(input_arg):
        files = sorted(f for f in os.listdir(input_arg) if f.lower().endswith(VIDEO_EXTENSIONS))
        if files:
            return input_arg, [VideoRecord({"video": os.path.join(input_arg, f)}, where=input_arg) for f in files]
        if any(os.path.isdir(os.path.join(input_arg, d)) for d in os.listdir(input_arg)):
            return input_arg, read_manifest(input_arg)  # root/<class>/<video>, as training reads it: labelled
        raise UsageError(
            f"--input {input_arg}: no videos in this directory nor in class folders under it "
            f"({', '.join(VIDEO_EXTENSIONS)})"
        )
    if input_arg.endswith((".jsonl", ".json", ".csv")):
        return input_arg, read_manifest(input_arg)
    if not os.path.exists(input_arg):
        raise UsageError(f"--input {input_arg}: file not found")
    return input_arg, [VideoRecord({"video": input_arg}, where=input_arg)]
