"""The data's shape: what a model and the memory planner need to know of the data (classes, camera views,
keypoints), in one value that training reads from its dataset, the planner from the manifest, and evaluation and
inference from a checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from config import Config
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.keypoints import read_keypoints
from datasets.mstcn import read_mapping
from datasets.records import read_split, resolve_class_names
from datasets.video_dataset import VideoWindowDataset

log = logging.getLogger("longvideo")


@dataclass(frozen=True)
class DataShape:
    num_classes: int
    num_views: int = 1
    view_names: tuple = ("video",)
    kpt_shape: tuple | None = None  # (joints, channels) of the keypoints; None without keypoints

    @classmethod
    def of_dataset(cls, dataset: VideoWindowDataset, class_names: list[str]) -> "DataShape":
        kpt = dataset.keypoint_shape()
        return cls(len(class_names), len(dataset.view_names), tuple(dataset.view_names), kpt)

    @classmethod
    def of_manifest(cls, cfg: Config) -> "DataShape":
        """From the training manifest, no video opened (the planner runs before any decoding); the model's
        defaults, with a warning, where the manifest cannot be read."""
        if cfg.data.features_dir is not None and cfg.data.features_format == "mstcn":  # no manifest: mapping.txt
            return cls(len(read_mapping(cfg.data.features_dir)))
        try:
            records = read_split(cfg.data, "train", labelled=cfg.train.reads_labels)
            kpt = (
                tuple(read_keypoints(records[0].keypoints, [0]).shape[1:])
                if cfg.data.load_kpt and records[0].keypoints
                else None
            )
            return cls(len(resolve_class_names(cfg.data, records)), len(records[0].views), tuple(records[0].views), kpt)
        except BAD_INPUT_ERRORS + (OSError, IndexError) as e:
            views = 1 if cfg.model.view_fusion == "none" else 3
            log.warning(
                "the training manifest cannot be read (%s): estimating for %d view(s), keypoints [17, 3], 10 classes",
                str(e).splitlines()[0],
                views,
            )
            return cls(10, views, tuple(f"view{i}" for i in range(views)), (17, 3) if cfg.data.load_kpt else None)

    def model_args(self) -> dict:
        """The keyword arguments of ``models.build_model`` and of the planner's estimates."""
        return {"num_classes": self.num_classes, "num_views": self.num_views, "kpt_shape": self.kpt_shape}
