"""Data: video reading, manifests, windowing, keypoints, transforms and the synthetic generator."""
from __future__ import annotations

import os

from datasets.manifest import ManifestError, read_manifest
from datasets.video_dataset import BAD_INPUT_ERRORS, VideoWindowDataset, worker_init  # noqa: F401
from datasets.video_reader import VideoIndexCache


def manifest_path(data_cfg: dict, split: str) -> str | None:
    name = data_cfg[f"{split}_manifest"]
    if name is None:
        return None
    return name if os.path.isabs(name) else os.path.join(data_cfg["data_dir"], name)


def resolve_class_names(data_cfg: dict, train_records) -> list[str]:
    if data_cfg["class_names"] is not None:
        return [str(n) for n in data_cfg["class_names"]]
    return sorted({label for r in train_records for label in r.labels()})


def index_cache_for(cfg: dict) -> VideoIndexCache:
    path = cfg["data"]["index_cache"] or os.path.join(cfg["trainer"]["output_dir"], ".video_index.json")
    return VideoIndexCache(path)


def build_dataset(cfg: dict, split: str, class_names: list[str], training: bool,
                  manifest: str | None = None, index_cache: VideoIndexCache | None = None) -> VideoWindowDataset:
    path = manifest or manifest_path(cfg["data"], split)
    if path is None:
        raise ManifestError(f"data.{split}_manifest is null; set it to a manifest file")
    return VideoWindowDataset(read_manifest(path), class_names, cfg["data"], training=training,
                              seed=cfg["train"]["seed"], index_cache=index_cache)
