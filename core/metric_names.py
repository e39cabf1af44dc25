"""The evaluation metrics' names, once, each with the words a plot or a log gives it: what engine/metrics computes,
what eval.py reports, and (with the "val_" prefix of metrics.csv's columns) what train.monitor may name."""

from __future__ import annotations

from typing import Literal

# a clip's or a video's label: shares of the evaluated clips or videos
CLIP_METRICS = {
    "clip_acc": "clip accuracy",
    "video_acc": "video accuracy",
    "mean_class_acc": "clip accuracy, mean over classes",
    "video_mean_class_acc": "video accuracy, mean over classes",
    "top5": "top-5 clip accuracy",
}
# a timeline's: frame accuracy a share of the frames, the others on the field's 0-100 scale
SEGMENT_METRICS = {
    "seg_frame_acc": "frame accuracy",
    "seg_edit": "edit",
    "seg_f1@10": "F1@10",
    "seg_f1@25": "F1@25",
    "seg_f1@50": "F1@50",
}
# train.objective: motion's: the share of training chunks whose pasted motion's direction is read within 22.5 degrees
MOTION_METRICS = {"direction_acc": "motion directions read right"}
VALIDATION_PREFIX = "val_"  # a validation metric's column in metrics.csv, and its name in the run's history
# what train.monitor may name: the metric that picks best.pt
Monitored = Literal[
    "val_video_acc",
    "val_clip_acc",
    "val_video_mean_class_acc",
    "val_mean_class_acc",
    "val_seg_f1@50",
    "val_seg_edit",
    "val_seg_frame_acc",
    "val_direction_acc",
]
