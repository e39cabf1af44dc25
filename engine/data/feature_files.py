"""Training on features (``data.features_dir``): each sample is one whole video's per-chunk features, as
``infer_chunked.py --features`` wrote them (engine/inference/features.py), with its labels from the manifests.

A video of 50,000 frames is about 2,000 chunks of features, a few MB: the temporal head trains over whole videos in
one forward, where end-to-end chunked training would run the backbone over every chunk twice per step. A sample:

    features      float32 [n, D]   each chunk's backbone features
    windows       float32 [n, 2]   each chunk's [start, end) in video frames (the head's positions)
    chunk_labels  int64 [n]        each chunk's label: the segment covering most of its frames (-1: none), or the
                                   video's label for every chunk when it has no segments
    frame_labels  int64 [frames]   each video frame's label (-1 where no segment is), for the timeline scores
    label         int64            the video's label, or the label covering most of its annotated frames

Batches pad every sample to the longest with a ``mask`` [B, n] (True for real chunks); the head ignores padding.
Every file must come from the same backbone checkpoint and chunking (a head trained on a mixture would learn two
feature spaces at once): the one the head's checkpoint records, so eval.py and infer_chunked.py can pair them.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from config import Config, DataConfig
from core.errors import ConfigError
from core.runtime import Runtime
from datasets.manifest import VideoRecord
from datasets.sample import Sample, whole_video_features
from datasets.mstcn import MsTcnVideos, bundle_names, feature_shape, read_mapping
from datasets.records import resolve_class_names, training_records
from datasets.sampler import EpochSampler
from engine.inference.features import read_arrays, read_header, video_labels

log = logging.getLogger("longvideo")
SOURCE_KEYS = ("checkpoint_sha256", "chunk", "overlap", "frame_stride", "feature_dim")  # must agree over files


def _views_key(views: dict) -> tuple:
    return tuple(sorted((name, os.path.abspath(path)) for name, path in views.items()))


class FeaturesDataset(Dataset):
    def __init__(self, records: list[VideoRecord], files: dict, class_names: list[str], split: str, features_dir: str):
        self.records, self.class_names = records, class_names
        missing = [r for r in records if _views_key(r.views) not in files]
        if missing:
            raise ConfigError(
                f"data.features_dir={features_dir}: no features file for {len(missing)} of the "
                f"{len(records)} {split} videos (first: {missing[0].first_path}, {missing[0].where}); "
                f"write them with: python infer_chunked.py --checkpoint BACKBONE.pt --input "
                f"<the {split} manifest> --features {features_dir}"
            )
        self.files = [files[_views_key(r.views)] for r in records]
        self.stall_folder = None  # no decoding: no sample deadline

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:  # no augmentation: every epoch reads the same features
        pass

    def __getitem__(self, index: int) -> Sample:
        path, header = self.files[index]
        record = self.records[index]
        features, windows = read_arrays(path)
        frames, per_chunk = video_labels(
            record, int(header["num_frames"]), float(header["fps"]), windows, self.class_names
        )
        annotated = frames[frames >= 0]
        if record.label is not None:
            label = self.class_names.index(record.label)
        else:  # the label covering most annotated frames
            label = int(np.bincount(annotated).argmax()) if len(annotated) else 0
        return whole_video_features(
            features, windows, per_chunk, frames, label, index, has_segments=record.segments is not None
        )


def collate_features(samples: list[Sample]) -> Sample:
    """Samples padded to the longest: features [B, n, D], windows [B, n, 2], chunk_labels [B, n] (-1 at padding),
    mask [B, n]; frame_labels [B, frames] padded with -1."""
    longest = max(len(s["features"]) for s in samples)
    frames = max(len(s["frame_labels"]) for s in samples)
    batch = {
        "features": torch.zeros(len(samples), longest, samples[0]["features"].shape[1]),
        "windows": torch.zeros(len(samples), longest, 2),
        "chunk_labels": torch.full((len(samples), longest), -1, dtype=torch.long),
        "mask": torch.zeros(len(samples), longest, dtype=torch.bool),
        "frame_labels": torch.full((len(samples), frames), -1, dtype=torch.long),
    }
    for i, s in enumerate(samples):
        n = len(s["features"])
        batch["features"][i, :n], batch["windows"][i, :n] = s["features"], s["windows"]
        batch["chunk_labels"][i, :n], batch["mask"][i, :n] = s["chunk_labels"], True
        if s["has_segments"]:  # scored as a timeline only where the manifest gives segments
            batch["frame_labels"][i, : len(s["frame_labels"])] = s["frame_labels"]
    batch["label"] = torch.tensor([s["label"] for s in samples])
    batch["video_index"] = torch.tensor([s["video_index"] for s in samples])
    return batch


def index_features(features_dir: str) -> tuple[dict, dict]:
    """(the files of ``features_dir`` by their video's views, the source they share: backbone checkpoint and
    chunking). Files from two sources are refused, naming one of each."""
    paths = sorted(glob.glob(os.path.join(features_dir, "*.npz")))
    if not paths:
        raise ConfigError(
            f"data.features_dir={features_dir}: no .npz features files there; write them with "
            f"python infer_chunked.py --checkpoint BACKBONE.pt --input MANIFEST "
            f"--features {features_dir}"
        )
    files, source, first = {}, None, None
    for path in paths:
        header = read_header(path)
        this = {key: header[key] for key in SOURCE_KEYS}
        rate = json.loads(header["settings"]).get("fps")
        if rate:  # data.fps: each video's stride its own; the rate must agree
            this["frame_stride"] = f"{rate:g} fps"
        if source is None:
            source, first = {**this, "checkpoint": header["checkpoint"]}, path
        elif any(source[key] != this[key] for key in SOURCE_KEYS):
            differ = ", ".join(f"{k} {source[k]} vs {this[k]}" for k in SOURCE_KEYS if source[k] != this[k])
            raise ConfigError(
                f"data.features_dir={features_dir}: {first} and {path} come from different backbones "
                f"or chunking ({differ}); a head trains on the features of one: write them all with "
                f"one checkpoint and --chunk/--overlap, in separate directories per backbone"
            )
        files[_views_key(header["views"])] = (path, header)
    return files, source


def index_feature_data(data: DataConfig) -> tuple[dict, dict]:
    """``index_features`` of data.features_dir in either data.features_format: for mstcn, each video of the
    split's two bundles by name, with its training sequence's length ("chunks"), and the source every video
    shares (the dataset, the split, the sample rate and the features' width)."""
    if data.features_format == "npz":
        return index_features(data.features_dir)
    root, rate = data.features_dir, data.frame_stride
    names = bundle_names(root, "train", data.features_split) + bundle_names(root, "test", data.features_split)
    files, dims = {}, {}
    for name in names:
        dims[name], frames = feature_shape(root, name)
        files[name] = (os.path.join(root, "features", f"{name}.npy"), {"chunks": -(-frames // rate)})
    if len(set(dims.values())) > 1:
        (a, da), (b, db) = next(iter(dims.items())), next((n, d) for n, d in dims.items() if d != dims[names[0]])
        raise ConfigError(
            f"data.features_dir={root}: features/{a}.npy has {da} features a frame, features/{b}.npy {db}; a head "
            f"trains on the features of one extraction"
        )
    source = {
        "format": "mstcn",
        "dataset": os.path.abspath(root),
        "split": data.features_split,
        "sample_rate": rate,
        "feature_dim": dims[names[0]],
        "checkpoint_sha256": "",  # no backbone here: the features came with the dataset
        "checkpoint": "",
    }
    return files, source


def _mstcn_data(data: DataConfig, source: dict) -> FeatureData:
    root, split = data.features_dir, data.features_split
    class_names = read_mapping(root)
    if data.class_names is not None and [str(n) for n in data.class_names] != class_names:
        raise ConfigError(
            f"data.class_names {data.class_names} differ from {os.path.join(root, 'mapping.txt')}'s "
            f"{class_names}; with data.features_format: mstcn the classes are mapping.txt's: leave data.class_names "
            f"null"
        )
    train_set = MsTcnVideos(root, bundle_names(root, "train", split), class_names, data.frame_stride)
    val_set = MsTcnVideos(root, bundle_names(root, "test", split), class_names, data.frame_stride)
    log.info(
        "training on MS-TCN's layout: %s split %d (%d training, %d test videos), %d-dim features every %d frames, "
        "%d classes",
        root,
        split,
        len(train_set),
        len(val_set),
        source["feature_dim"],
        data.frame_stride,
        len(class_names),
    )
    return FeatureData(train_set, val_set, class_names, source)


def test_videos(data: DataConfig) -> MsTcnVideos:
    """The test bundle of data.features_split (MS-TCN's layout): what eval.py scores a head trained on it with."""
    root = data.features_dir
    return MsTcnVideos(root, bundle_names(root, "test", data.features_split), read_mapping(root), data.frame_stride)


class FeatureData(NamedTuple):
    """What a head trained on features trains and validates on (unpacks as the 4-tuple it was)."""

    train_set: FeaturesDataset | MsTcnVideos
    val_set: FeaturesDataset | MsTcnVideos | None
    class_names: list
    source: dict  # the backbone checkpoint and chunking every file shares (index_features)


def build_feature_data(cfg: Config, index: tuple | None = None) -> FeatureData:
    """The training and validation sets of ``data.features_dir``, their class names and the features' source;
    ``index`` is its ``index_features`` when the caller read it already."""
    files, source = index or index_feature_data(cfg.data)
    if cfg.data.features_format == "mstcn":
        return _mstcn_data(cfg.data, source)
    train_records, val_records = training_records(cfg.data)
    class_names = resolve_class_names(cfg.data, train_records)
    train_set = FeaturesDataset(train_records, files, class_names, "train", cfg.data.features_dir)
    val_set = (
        FeaturesDataset(val_records, files, class_names, "val", cfg.data.features_dir)
        if val_records is not None
        else None
    )
    log.info(
        "training on features: %s (%d files, %d-dim, chunk %d overlap %d at stride %d, from the backbone "
        "checkpoint %s, sha256 %s...)",
        cfg.data.features_dir,
        len(files),
        source["feature_dim"],
        source["chunk"],
        source["overlap"],
        source["frame_stride"],
        source["checkpoint"] or "(not recorded)",
        source["checkpoint_sha256"][:12],
    )
    return FeatureData(train_set, val_set, class_names, source)


def feature_loader(
    dataset: FeaturesDataset | MsTcnVideos, seed: int, runtime: Runtime, batch_size: int, shuffle: bool, pad: bool
) -> DataLoader:
    """The features read in this process: a file is a few MB, no decoding to hide."""
    sampler = EpochSampler(
        len(dataset), shuffle=shuffle, seed=seed, rank=runtime.rank, world_size=runtime.world_size, pad=pad
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=0, collate_fn=collate_features)
