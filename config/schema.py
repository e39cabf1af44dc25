"""Every configuration key, once: its default, type, range and meaning (``SCHEMA``). ``configs/base.yaml``
mirrors the defaults for readers and a test keeps the two equal."""
from __future__ import annotations

import copy
import difflib
import logging
from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError

log = logging.getLogger("longvideo")

# The RGB backbones a config may name. The schema owns the names; models/ registers one builder for each, and
# registering a name missing here fails at import (so config never imports the model registry above it).
BACKBONES = ("tiny3d", "vgg3d", "r3d_18", "mc3_18", "r2plus1d_18", "s3d", "swin3d_t", "mvit_v2_s", "resnet18",
             "resnet34", "resnet50")
NORMS = ("batch", "frozen", "sync", "group")  # model.norm: models/norms.py converts BatchNorm to each


@dataclass(frozen=True)
class Key:
    default: Any
    kind: str  # int, float, bool, str, list, choice, size, precision, any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    nullable: bool = False
    also: tuple = ()  # extra single values allowed outside [minimum, maximum], e.g. -1 for "all"
    refused: tuple = ()  # (value, why) pairs: values a user may expect to work, refused with their reason


def _int(default, help, minimum=None, maximum=None, nullable=False, also=()):
    return Key(default, "int", help, minimum, maximum, nullable=nullable, also=also)


def _float(default, help, minimum=None, maximum=None, nullable=False):
    return Key(default, "float", help, minimum, maximum, nullable=nullable)


def _choice(default, help, *choices):
    return Key(default, "choice", help, choices=choices)


SCHEMA: dict[str, Any] = {
    "experiment": Key("default", "str", "run name: results go to <trainer.output_dir>/<experiment>/<timestamp>/"),
    "model": {
        "backbone": Key("tiny3d", "str", "model name from the registry (python -m models --list)"),
        "model_class_num": _int(None, "number of classes; null = from data.class_names or the training labels",
                                minimum=2, nullable=True),
        "input_type": _choice("rgb", "what the model sees", "rgb", "kpt", "rgb_kpt"),
        "view_fusion": _choice("none", "how camera views are combined", "none", "late", "mean", "concat"),
        "grad_checkpointing": Key(False, "bool", "recompute each stage's activations in backward"),
        "dropout": _float(0.0, "dropout before the classifier", 0.0, 1.0),
        "width": _int(32, "base channel width of the small models (tiny3d, keypoint branch)", minimum=1),
        "pretrained": Key(None, "any", "null, a local weights file (torchvision's .pth files work as they are), or "
                                       "true for torchvision's download"),
        "fusion": _choice("concat", "how RGB and keypoint features combine (rgb_kpt): concat, or weighted (a learned "
                                    "weighting of both, projected to one size)", "concat", "weighted"),
        "norm": _choice("batch", "the BatchNorm layers of every backbone: batch (statistics of each micro-batch or "
                                 "training chunk), frozen (the pretrained running statistics, never updated: "
                                 "fine-tuning at batch 1-2), sync (statistics over every torchrun process; "
                                 "BatchNorm on one) or group (GroupNorm: per sample, for training from scratch)",
                        *NORMS),
        "norm_groups": _int(32, "norm: group: groups per layer, lowered to the nearest divisor of its channels that "
                                      "leaves 2 channels a group",
                            minimum=1),
        "norm_frozen_affine": Key(False, "bool", "norm: frozen: also freeze the BatchNorm scale and shift (false: "
                                                 "they train, as MMAction2's norm_eval)"),
        "temporal_head": _choice("none", "the model over a clip's chunk features: none (chunk logits aggregated by "
                                         "train.chunk_aggregation, blind to order), attention (attention pooling with "
                                         "positions) or transformer (an encoder over the chunks, then that pooling)",
                                 "none", "attention", "transformer"),
        "temporal_width": _int(64, "temporal head: token width", minimum=2),
        "temporal_layers": _int(2, "temporal head (transformer): encoder layers", minimum=1),
        "temporal_heads": _int(4, "temporal head: attention heads (must divide temporal_width)", minimum=1),
        "temporal_dropout": _float(0.1, "temporal head: dropout in attention, feed-forward and before its classifier",
                                   0.0, 1.0),
    },
    "data": {
        "data_dir": Key("data/synthetic", "str", "directory the manifests are resolved against"),
        "val_fraction": _float(None, "split this share of the training videos off as validation (by a hash of each "
                                     "video's path: the same split every run), instead of data.val_manifest",
                               0.0, 1.0, nullable=True),
        "train_manifest": Key("train.jsonl", "str", "training manifest (JSONL, CSV or a root/<class>/ folder)"),
        "val_manifest": Key("val.jsonl", "str", "validation manifest", nullable=True),
        "test_manifest": Key("test.jsonl", "str", "test manifest", nullable=True),
        "class_names": Key(None, "list", "class names in label order; null = sorted training labels",
                           nullable=True),
        "batch_size": _int(8, "clips per training micro-batch; auto = the largest whose estimated memory fits "
                              "trainer.memory_budget_gb (train.py --probe-memory shows the estimates)", minimum=1,
                           also=("auto",)),
        "num_workers": _int(2, "DataLoader worker processes", minimum=0),
        "prefetch_factor": _int(2, "batches each DataLoader worker loads ahead (with num_workers > 0); host memory "
                                   "holds num_workers x prefetch_factor batches (train.py --probe-memory)", minimum=1),
        "img_size": Key(112, "size", "the model's frame size, after resize and crop: N (square) or [height, width]"),
        "resize": _choice("short_side", "short_side: keep the aspect ratio (short side to data.short_side), then crop "
                                        "to img_size; stretch: decode straight to img_size", "short_side", "stretch"),
        "short_side": _int(None, "decoded short side (resize: short_side); null = the least that holds the img_size "
                                 "crop", minimum=1, nullable=True),
        "test_clips": _int(1, "temporal clips per sample window at evaluation, evenly spaced (first at the "
                                 "window's start, last at its end; 1: centred), each times data.test_crops; the "
                                 "video-level result averages all views", minimum=1),
        "test_crops": Key(1, "int", "spatial crops per clip at evaluation: 1 (centre) or 3 (along the long side)",
                          1, 3, refused=((2, "use 1 (the centre) or 3 (start, centre, end of the long side)"),)),
        "augment": Key(False, "bool", "training augmentation: random resized crop, flip, colour jitter (never at "
                                      "evaluation)"),
        "crop_scale": Key([0.35, 1.0], "list", "augment: area share of the decoded frame a random crop covers "
                                                "[min, max]"),
        "crop_ratio": Key([0.75, 1.3333], "list", "augment: aspect ratio of a random crop, relative to img_size's "
                                                   "[min, max]"),
        "flip": Key(True, "bool", "augment: horizontal flip with probability 0.5"),
        "color_jitter": _float(0.0, "augment: brightness, contrast and saturation factors in [1-s, 1+s]; 0 = off",
                               0.0, 1.0),
        "flip_label_pairs": Key(None, "list", "augment: classes that swap when a clip is flipped, [[swipe_left, "
                                              "swipe_right], ...]", nullable=True),
        "kpt_coords": _choice("normalized", "keypoint x, y: normalized (0..1 of the frame) or pixels (of the "
                                            "stored frame)", "normalized", "pixels"),
        "kpt_flip_pairs": Key(None, "list", "augment + flip + keypoints: joint indices that swap in a flip, "
                                            "[[5, 6], ...]; [] if no joint has a side", nullable=True),
        "num_frames": _int(16, "frames per clip; -1 = every frame of the sample window", minimum=1, also=(-1,)),
        "frame_stride": _int(1, "distance between the decoded frames of a clip", minimum=1),
        "load_rgb": Key(True, "bool", "decode video frames"),
        "load_kpt": Key(False, "bool", "load per-frame keypoints"),
        "max_video_frames": _int(None, "split videos into sample windows of at most this many frames; "
                                       "null = whole videos", minimum=1, nullable=True),
        "sample_window_overlap": _int(0, "frames shared by consecutive sample windows", minimum=0),
        "decoder": _choice("auto", "video decoder: auto (the faster exact one for each codec and access pattern, "
                                   "measured by bench/loader.py), opencv, or pyav (same frames and pixels; also reads "
                                   "AV1)", "auto", "opencv", "pyav"),
        "autorotate": Key(True, "bool", "frames as a viewer sees them: the container's display rotation or mirror "
                                        "(a phone held upright) applied by every decoder; false = as stored"),
        "on_bad_video": _choice("raise", "a video that cannot be read: stop, or log it and use another sample",
                                "raise", "skip"),
        "sample_timeout_s": _float(300.0, "seconds one sample (or a file's header at indexing, or a group of "
                                          "inference chunks) may take to load before it counts as a bad video "
                                          "(a stalled mount); null = no deadline", minimum=0.001, nullable=True),
        "index_cache": Key(None, "str", "JSON cache of video metadata; null = <trainer.output_dir>/.video_index.json",
                           nullable=True),
        "mean": Key([0.45, 0.45, 0.45], "list", "per-channel mean (RGB, 0..1) for normalization on the device"),
        "std": Key([0.225, 0.225, 0.225], "list", "per-channel std (RGB, 0..1)"),
        "pin_memory": Key(True, "bool", "page-locked host batches for non_blocking copies (CUDA only)"),
    },
    "train": {
        "chunk_infer_size": _int(-1, "frames per inference chunk at evaluation; -1 = the whole clip at once",
                                 minimum=1, also=(-1,)),
        "chunk_overlap": _int(0, "frames shared by consecutive inference chunks", minimum=0),
        "chunk_aggregation": _choice("mean", "how chunk logits become one prediction",
                                     "mean", "max", "last", "prob"),
        "video_batch_size": _int(1, "inference chunks per forward call at evaluation", minimum=1),
        "chunk_train_size": _int(-1, "frames per chunk of a training clip, each chunk recomputed in backward so "
                                     "training memory no longer grows with the clip; -1 = the whole clip in one "
                                     "forward", minimum=1, also=(-1,)),
        "chunk_train_overlap": _int(0, "frames shared by consecutive training chunks", minimum=0),
        "chunk_train_aggregation": Key("mean", "choice", "how the chunk logits of a training clip become its "
                                                        "prediction for the loss (chunk_loss: clip)",
                                       choices=("mean", "max", "prob"),
                                       refused=(("last", "'last' means nothing in training (only the last chunk "
                                                         "would learn); use mean, max or prob. Validation's "
                                                         "train.chunk_aggregation may stay last"),)),
        "chunk_loss": _choice("clip", "clip: one loss per clip on the aggregated chunk logits; dense: one loss per "
                                      "chunk against the label covering most of its frames (segments)",
                              "clip", "dense"),
        "accumulate_grad_batches": _int(1, "micro-batches per optimizer step", minimum=1),
        "global_batch_size": _int(None, "clips per optimizer step over all processes, kept by data.batch_size: auto "
                                        "and --fit-budget through accumulate_grad_batches; null = batch_size x "
                                        "accumulate_grad_batches x processes as written", minimum=1, nullable=True),
        "optimizer": _choice("adamw", "optimizer", "adamw", "sgd"),
        "lr": _float(1e-3, "peak learning rate", minimum=0.0),
        "min_lr": _float(0.0, "learning rate at the end of the cosine schedule", minimum=0.0),
        "weight_decay": _float(0.05, "decoupled weight decay (AdamW) or L2 (SGD)", minimum=0.0),
        "momentum": _float(0.9, "SGD momentum", 0.0, 1.0),
        "warmup_epochs": _float(0.0, "linear warm-up length in epochs (fractions allowed)", minimum=0.0),
        "grad_clip": _float(None, "clip the gradient norm to this value (after unscaling); null = off",
                            minimum=0.0, nullable=True),
        "temporal_lr_scale": _float(0.3, "temporal head: its learning rate is train.lr times this (its own parameter "
                                         "groups, the same schedule); 1 = the backbone's", minimum=0.0),
        "temporal_grad_clip": _float(1.0, "temporal head on: clip the whole model's gradient norm to this value "
                                          "unless train.grad_clip is set; null = off", minimum=0.0, nullable=True),
        "label_smoothing": _float(0.0, "cross-entropy label smoothing", 0.0, 1.0),
        "precise_bn_batches": _int(0, "before each validation, recompute the BatchNorm running statistics as the "
                                      "true mean and variance over this many training batches (precise BN); 0 = "
                                      "off", minimum=0),
        "seed": _int(0, "seed for weights, sampling and clip placement", minimum=0),
        "log_every": _int(20, "log (and record memory) every N optimizer steps", minimum=1),
        "checkpoint_every_steps": _int(0, "also write last.pt every N optimizer steps; 0 = epoch ends only",
                                       minimum=0),
        "keep_last_k": _int(2, "epoch checkpoints kept besides last.pt and best.pt", minimum=0),
        "monitor": _choice("val_video_acc", "metric that picks best.pt (higher is better)",
                           "val_video_acc", "val_clip_acc"),
    },
    "trainer": {
        "precision": Key("32", "precision", "32 | 16 | bf16 (also 16-mixed, bf16-mixed); amp = 16 on CUDA, "
                                            "bf16 on CPU"),
        "max_epochs": _int(10, "training epochs", minimum=1),
        "check_val_every_n_epoch": _int(1, "validate every N epochs (and after the last)", minimum=1),
        "device": Key("auto", "str", "auto (cuda if available), cpu, cuda or cuda:N"),
        "output_dir": Key("runs", "str", "where run directories are created"),
        "memory_budget_gb": _float(None, "the device memory this preset is sized for (--probe-memory uses it)",
                                   minimum=0.0, nullable=True),
        "compile": Key(False, "bool", "torch.compile the model"),
        "channels_last_3d": Key(False, "bool", "channels_last_3d memory format for 3D CNNs on CUDA"),
        "allow_tf32": Key(True, "bool", "TF32 matmuls and convolutions on Ampere and newer"),
        "max_nonfinite_steps": _int(20, "consecutive non-finite losses that stop the run", minimum=1),
        "leak_check_epochs": _int(3, "epochs of steady memory growth before the leak warning", minimum=1),
        "leak_tolerance_mb": _float(256.0, "total growth (MB) over those epochs that triggers it", minimum=0.0),
    },
}

# Keys renamed, old name -> new: the old name keeps working (a preset with a one-line notice, a checkpoint's saved
# config silently). "chunk" is the window of one forward pass; a sample window was once called a chunk too.
RENAMED_KEYS = {"data.video_chunk_overlap": "data.sample_window_overlap"}


def with_new_names(data: dict, source: str | None = None) -> dict:
    """``data`` (a config's sections) with each renamed key under its new name; with ``source`` (a file or a
    --set), each old name found is said once, naming the new one."""
    for old, new in RENAMED_KEYS.items():
        section, old_key = old.split(".")
        values = data.get(section)
        if not isinstance(values, dict) or old_key not in values:
            continue
        new_key = new.split(".")[1]
        if new_key in values:
            raise ConfigError(f"{source or 'a saved config'}: {old} and {new} are the same key (renamed); keep {new}")
        values = {(new_key if k == old_key else k): v for k, v in values.items()}
        data = {**data, section: values}
        if source is not None:
            log.warning("%s: %s is now called %s (the old name still works)", source, old, new)
    return data


def defaults() -> dict:
    def build(node):
        return {k: build(v) if isinstance(v, dict) else copy.deepcopy(v.default) for k, v in node.items()}
    return build(SCHEMA)


def flat_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in node.items():
        keys.extend(flat_keys(value, f"{prefix}{name}.") if isinstance(value, dict) else [prefix + name])
    return keys


ALL_KEYS = flat_keys(SCHEMA)


def did_you_mean(dotted: str) -> str:
    leaf = dotted.rsplit(".", 1)[-1]
    candidates = difflib.get_close_matches(dotted, ALL_KEYS, n=1, cutoff=0.6)
    if not candidates:  # a key put in the wrong section: match on its last part
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in ALL_KEYS}
        close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.7)
        candidates = [by_leaf[close[0]]] if close else []
    return f"; did you mean '{candidates[0]}'?" if candidates else ""
