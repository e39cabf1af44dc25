"""YAML presets: inheritance, strict validation, command-line overrides.

A config is a plain nested dict (``cfg["data"]["batch_size"]``). Every key, its default, its type and
its allowed range are declared once, in ``SCHEMA`` below; ``configs/base.yaml`` mirrors the defaults
for readers and a test keeps the two equal.

Errors are ``ConfigError``: one line naming the file (or ``--set``), the key, what is wrong and how to
fix it. The scripts print it and exit with code 2.
"""
from __future__ import annotations

import copy
import difflib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable

import yaml

from core.errors import ConfigError
from core.runtime import PRECISION_ALIASES

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
        "temporal_width": _int(128, "temporal head: token width", minimum=2),
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
        "video_chunk_overlap": _int(0, "frames shared by consecutive sample windows", minimum=0),
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

def defaults() -> dict:
    def build(node):
        return {k: build(v) if isinstance(v, dict) else copy.deepcopy(v.default) for k, v in node.items()}
    return build(SCHEMA)


# keys added since a saved config may have been written, with the value that reproduces what the code did then
# (before data.resize, every frame was stretched to data.img_size)
# model.norm_groups: GroupNorm had gcd(8, channels) groups before the key (the same for 16 channels or more)
_BEFORE_THE_KEY = {"data.resize": "stretch", "model.norm_groups": 8}


def saved_config(cfg: dict) -> dict:
    """A config saved with a checkpoint, validated; keys it predates get the behaviour it was trained with (or
    the default), so an older checkpoint evaluates as it was trained."""
    full = defaults()
    for dotted, value in _BEFORE_THE_KEY.items():
        section, key = dotted.split(".")
        if key not in cfg.get(section, {}):
            full[section][key] = value
    for section, values in cfg.items():
        if isinstance(values, dict) and isinstance(full.get(section), dict):
            full[section].update(values)
        else:
            full[section] = values
    return validate(full)


def _flat_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in node.items():
        keys.extend(_flat_keys(value, f"{prefix}{name}.") if isinstance(value, dict) else [prefix + name])
    return keys


ALL_KEYS = _flat_keys(SCHEMA)


def _did_you_mean(dotted: str) -> str:
    leaf = dotted.rsplit(".", 1)[-1]
    candidates = difflib.get_close_matches(dotted, ALL_KEYS, n=1, cutoff=0.6)
    if not candidates:  # a key put in the wrong section: match on its last part
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in ALL_KEYS}
        close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.7)
        candidates = [by_leaf[close[0]]] if close else []
    return f"; did you mean '{candidates[0]}'?" if candidates else ""


# ---------------------------------------------------------------------------------------------- loading

def _read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found; presets live in configs/ (e.g. configs/quickstart.yaml)")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = str(getattr(e, "problem", e))
        fix = "; indent with spaces, not tabs" if "\\t" in problem or "\t" in problem else ""
        raise ConfigError(f"{path}:{where} is not valid YAML ({problem}){fix}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a mapping of sections (model:, data:, ...), got "
                          f"{type(data).__name__}")
    return data


def _merge(into: dict, update: dict, origins: dict, source: str, prefix: str = "") -> None:
    for key, value in update.items():
        dotted = prefix + str(key)
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, origins, source, dotted + ".")
        else:
            into[key] = copy.deepcopy(value)
            for leaf in (_flat_keys(value, dotted + ".") if isinstance(value, dict) else [dotted]):
                origins[leaf] = source
            origins.setdefault(dotted, source)


def _load_chain(path: str, seen: tuple = ()) -> list[tuple[str, dict]]:
    """The files of an inheritance chain, root first: [(path, data), ...]."""
    real = os.path.realpath(path)
    if real in seen:
        raise ConfigError(f"{path}: 'base' inheritance loops back to this file; remove one of the 'base:' lines")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return [(path, data)]
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: must be a file name such as base.yaml, got {base!r}")
    base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
    if not os.path.exists(base_path):
        raise ConfigError(f"{path}: base: {base} not found ({base_path}); a base is resolved relative to the file "
                          f"that names it: fix the 'base:' line, e.g. base: base.yaml")
    return _load_chain(base_path, seen + (real,)) + [(path, data)]


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected KEY=VALUE, e.g. --set data.batch_size=8")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | None, overrides: list[str] = (), use_amp: bool = False,
                origins: dict | None = None) -> dict:
    """Defaults <- the preset's base chain <- the preset <- each --set; then validated. ``origins``, if given, is
    filled with where each key was set (a file, or "--set KEY=VALUE"; keys left at their defaults are absent)."""
    cfg = defaults()
    origins = {} if origins is None else origins
    if path is not None:
        for file_path, data in _load_chain(path):
            _merge(cfg, data, origins, file_path)
    for text in overrides:
        key, value = parse_override(text)
        update: dict = {}
        node = update
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        _merge(cfg, update, origins, f"--set {text}")
    if use_amp:
        cfg["trainer"]["precision"] = "amp"
        origins["trainer.precision"] = "--use_amp"
    return validate(cfg, origins)


# ------------------------------------------------------------------------------------------- validation

def _check_value(spec: Key, value: Any, where: str) -> Any:
    def fail(expected: str):
        raise ConfigError(f"{where} must be {expected}, got {value!r}")

    if value is None:
        if spec.nullable or spec.kind == "any":
            return None
        fail(_describe(spec))
    if isinstance(value, (str, int, float)) and value in dict(spec.refused):
        raise ConfigError(f"{where}: {dict(spec.refused)[value]}")
    kind = spec.kind
    if kind == "bool":
        if not isinstance(value, bool):
            fail("true or false")
    elif kind == "int":
        if isinstance(value, str) and value in spec.also:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            fail(_describe(spec))
        if value not in spec.also and not _in_range(spec, value):
            fail(_describe(spec))
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(_describe(spec))
        value = float(value)
        if not _in_range(spec, value):
            fail(_describe(spec))
    elif kind == "str":
        if not isinstance(value, str) or not value:
            fail("a non-empty string")
    elif kind == "choice":
        if value not in spec.choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(spec.choices)}")
    elif kind == "list":
        if not isinstance(value, list):
            fail("a list such as [a, b]")
    elif kind == "size":
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return [value, value]
        if (isinstance(value, list) and len(value) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
            return list(value)
        fail("a positive integer or [height, width]")
    elif kind == "precision":
        normal = PRECISION_ALIASES.get(str(value).lower())
        if normal is None:
            raise ConfigError(f"{where}: {value!r} is not one of 32, 16, bf16, 16-mixed, bf16-mixed, amp")
        return normal
    return value


def _in_range(spec: Key, value) -> bool:
    return ((spec.minimum is None or value >= spec.minimum)
            and (spec.maximum is None or value <= spec.maximum))


def _describe(spec: Key) -> str:
    noun = {"int": "an integer", "float": "a number"}.get(spec.kind, spec.kind)
    parts = []
    if spec.minimum is not None:
        parts.append(f">= {spec.minimum:g}")
    if spec.maximum is not None:
        parts.append(f"<= {spec.maximum:g}")
    text = noun + (" " + " and ".join(parts) if parts else "")
    for extra in spec.also:
        text += f" (or {extra})"
    if spec.nullable:
        text += " (or null)"
    return text


def validate(cfg: dict, origins: dict | None = None) -> dict:
    origins = origins or {}

    def origin(dotted: str) -> str:
        # the file that set this key, or the file that set the section it sits in
        while dotted:
            if dotted in origins:
                return origins[dotted]
            dotted = dotted.rpartition(".")[0]
        return "defaults"

    def walk(node: dict, schema: dict, prefix: str) -> None:
        for key in list(node):
            dotted = prefix + str(key)
            if key not in schema:
                raise ConfigError(f"{origin(dotted)}: unknown key '{dotted}'{_did_you_mean(dotted)}")
            spec = schema[key]
            if isinstance(spec, dict):
                if not isinstance(node[key], dict):
                    raise ConfigError(f"{origin(dotted)}: {dotted} must be a section (a mapping), "
                                      f"got {node[key]!r}")
                walk(node[key], spec, dotted + ".")
            else:
                node[key] = _check_value(spec, node[key], f"{origin(dotted)}: {dotted}")

    walk(cfg, SCHEMA, "")
    _cross_checks(cfg, origin)
    return cfg


def _number_pair(data: dict, key: str, origin: Callable[[str], str], low: float, high: float) -> None:
    value = data[key]
    if not (len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            and low < value[0] <= value[1] <= high):
        raise ConfigError(f"{origin('data.' + key)}: data.{key} must be [min, max] with {low:g} < min <= max <= "
                          f"{high:g}, got {value!r}")


def _augmentation_checks(data: dict, origin: Callable[[str], str]) -> None:
    _number_pair(data, "crop_scale", origin, 0.0, 1.0)
    _number_pair(data, "crop_ratio", origin, 0.0, float("inf"))
    for key in ("flip_label_pairs", "kpt_flip_pairs"):
        pairs = data[key]
        if pairs is not None and not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise ConfigError(f"{origin('data.' + key)}: data.{key} must be a list of pairs such as [[a, b], [c, d]], "
                              f"got {pairs!r}")
    pairs = data["kpt_flip_pairs"] or []
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for p in pairs for v in p):
        raise ConfigError(f"{origin('data.kpt_flip_pairs')}: data.kpt_flip_pairs holds joint indices (integers from "
                          f"0), got {data['kpt_flip_pairs']!r}")
    names = data["class_names"]
    for pair in data["flip_label_pairs"] or []:
        unknown = [str(v) for v in pair if names is not None and str(v) not in map(str, names)]
        if unknown:
            raise ConfigError(f"{origin('data.flip_label_pairs')}: data.flip_label_pairs names {', '.join(unknown)}, "
                              f"not in data.class_names")
    if data["augment"] and data["flip"] and data["load_kpt"] and data["kpt_flip_pairs"] is None:
        raise ConfigError(f"{origin('data.augment')}: a horizontal flip must swap left and right joints of the "
                          f"keypoints: set data.kpt_flip_pairs (joint index pairs, e.g. [[1, 2], [3, 4]]; [] if no "
                          f"joint has a side), or data.flip: false")


def _temporal_head_checks(cfg: dict, origin: Callable[[str], str]) -> None:
    """A temporal head is the aggregation: the settings that would aggregate otherwise must not contradict it."""
    model, train = cfg["model"], cfg["train"]
    if train["chunk_aggregation"] == "last":
        raise ConfigError(f"{origin('train.chunk_aggregation')}: train.chunk_aggregation: last runs only the last "
                          f"chunk, but model.temporal_head={model['temporal_head']} needs every chunk's features (the "
                          f"head is the aggregation); use mean (ignored with a head)")
    if model["view_fusion"] == "late":
        raise ConfigError(f"{origin('model.view_fusion')}: model.view_fusion: late keeps one feature vector per view, "
                          f"but model.temporal_head needs one per chunk; use mean or concat")
    if model["temporal_width"] % model["temporal_heads"]:
        raise ConfigError(f"{origin('model.temporal_heads')}: model.temporal_heads={model['temporal_heads']} must "
                          f"divide model.temporal_width={model['temporal_width']}")


def _norm_checks(cfg: dict, origin: Callable[[str], str]) -> None:
    """model.norm against the weights it starts from and train.precise_bn_batches."""
    model, norm = cfg["model"], cfg["model"]["norm"]
    if norm == "frozen" and model["pretrained"] is None:
        raise ConfigError(f"{origin('model.norm')}: model.norm: frozen keeps the BatchNorm statistics of pretrained "
                          f"weights, but model.pretrained is null (they would stay mean 0, variance 1: no "
                          f"normalization); set model.pretrained to a weights file or true, or use norm: group to "
                          f"train from scratch")
    if norm == "frozen" and model["input_type"] != "rgb":
        raise ConfigError(f"{origin('model.norm')}: model.norm: frozen needs pretrained statistics in every branch, "
                          f"and the keypoint branch of input_type {model['input_type']} has none (model.pretrained "
                          f"loads the RGB backbone); use norm: group, sync or batch")
    if norm == "group" and model["pretrained"] is True:
        raise ConfigError(f"{origin('model.norm')}: model.norm: group replaces BatchNorm, whose statistics "
                          f"torchvision's pretrained weights (model.pretrained: true) hold; use norm: frozen (or "
                          f"batch) to fine-tune them, or model.pretrained: null to train GroupNorm from scratch")
    if cfg["train"]["precise_bn_batches"] and norm in ("frozen", "group"):
        raise ConfigError(f"{origin('train.precise_bn_batches')}: train.precise_bn_batches recomputes BatchNorm "
                          f"statistics, but model.norm: {norm} "
                          f"{'keeps them fixed' if norm == 'frozen' else 'has none'}; set precise_bn_batches: 0, or "
                          f"norm: batch or sync")


def _cross_checks(cfg: dict, origin: Callable[[str], str]) -> None:
    data, train, model = cfg["data"], cfg["train"], cfg["model"]
    chunk, overlap = train["chunk_infer_size"], train["chunk_overlap"]
    if chunk != -1 and overlap >= chunk:
        raise ConfigError(f"{origin('train.chunk_overlap')}: train.chunk_overlap={overlap} must be smaller than "
                          f"train.chunk_infer_size={chunk} (or set chunk_infer_size: -1 for no chunking)")
    chunk, overlap = train["chunk_train_size"], train["chunk_train_overlap"]
    if chunk != -1 and overlap >= chunk:
        raise ConfigError(f"{origin('train.chunk_train_overlap')}: train.chunk_train_overlap={overlap} must be smaller "
                          f"than train.chunk_train_size={chunk} (or set chunk_train_size: -1 for no chunking)")
    if model["temporal_head"] != "none":
        _temporal_head_checks(cfg, origin)
    _norm_checks(cfg, origin)
    if data["batch_size"] == "auto" and not cfg["trainer"]["memory_budget_gb"]:
        raise ConfigError(f"{origin('data.batch_size')}: data.batch_size: auto needs trainer.memory_budget_gb (the "
                          f"memory to fit, in GiB); set it, or give a number")
    window, window_overlap = data["max_video_frames"], data["video_chunk_overlap"]
    if window is not None and window_overlap >= window:
        raise ConfigError(f"{origin('data.video_chunk_overlap')}: data.video_chunk_overlap={window_overlap} must be "
                          f"smaller than data.max_video_frames={window}")
    if data["decoder"] == "pyav" and data["load_rgb"] and importlib.util.find_spec("av") is None:
        raise ConfigError(f"{origin('data.decoder')}: data.decoder: pyav needs PyAV, which is not installed; "
                          f"pip install av, or set data.decoder: opencv")
    needs_rgb = model["input_type"] in ("rgb", "rgb_kpt")
    needs_kpt = model["input_type"] in ("kpt", "rgb_kpt")
    if needs_rgb and not data["load_rgb"]:
        raise ConfigError(f"{origin('model.input_type')}: model.input_type={model['input_type']} needs frames; "
                          f"set data.load_rgb: true")
    if needs_kpt and not data["load_kpt"]:
        raise ConfigError(f"{origin('model.input_type')}: model.input_type={model['input_type']} needs keypoints; "
                          f"set data.load_kpt: true")
    _augmentation_checks(data, origin)
    for name in ("mean", "std"):
        values = data[name]
        if len(values) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{origin('data.' + name)}: data.{name} must be three numbers (R, G, B), got {values!r}")
    if any(v <= 0 for v in data["std"]):
        raise ConfigError(f"{origin('data.std')}: data.std must be positive, got {data['std']!r}")
    if train["min_lr"] > train["lr"]:
        raise ConfigError(f"{origin('train.min_lr')}: train.min_lr={train['min_lr']:g} must not exceed "
                          f"train.lr={train['lr']:g}")
    pretrained = model["pretrained"]
    if not (pretrained is None or pretrained is True or (isinstance(pretrained, str) and pretrained)):
        raise ConfigError(f"{origin('model.pretrained')}: model.pretrained must be null, true, or a weights file "
                          f"path, got {pretrained!r}")
    names = data["class_names"]
    if names is not None and len(set(map(str, names))) != len(names):
        raise ConfigError(f"{origin('data.class_names')}: data.class_names has duplicates: {names!r}")
    device = cfg["trainer"]["device"]
    if not (device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ConfigError(f"{origin('trainer.device')}: trainer.device: {device!r} is not one of auto, cpu, cuda, "
                          f"cuda:N")
    if model["backbone"] not in BACKBONES:
        raise ConfigError(f"{origin('model.backbone')}: model.backbone: unknown model '{model['backbone']}'; "
                          f"known: {', '.join(sorted(BACKBONES))}")


def apply_flags(cfg: dict, flags: dict) -> dict:
    """A validated copy of ``cfg`` with command-line flags applied: ``{"train.chunk_overlap": ("--overlap", 8)}``
    (a value of None leaves the key as it is). Errors name the flag, as --set's name --set."""
    changed, origins = copy.deepcopy(cfg), {}
    for dotted, (flag, value) in flags.items():
        if value is None:
            continue
        section, key = dotted.split(".")
        changed[section][key] = value
        origins[dotted] = flag
    return validate(changed, origins)


# The one table from eval.py's and infer_chunked.py's flags to the config keys they override.
INFERENCE_FLAGS = {
    "--chunk": "train.chunk_infer_size",
    "--overlap": "train.chunk_overlap",
    "--agg": "train.chunk_aggregation",
    "--batch": "train.video_batch_size",
    "--num-frames": "data.num_frames",
    "--crops": "data.test_crops",
    "--clips": "data.test_clips",
    "--sample-timeout": "data.sample_timeout_s",
}


def apply_inference_flags(cfg: dict, values: dict) -> dict:
    """A validated copy of ``cfg`` with ``{"--chunk": 32, ...}`` applied (None leaves the key); errors name
    the flag."""
    head = cfg["model"]["temporal_head"]
    if values.get("--agg") is not None and head != "none":
        raise ConfigError(f"--agg {values['--agg']}: this model has a temporal head (model.temporal_head: {head}), "
                          f"which is the aggregation over its chunks; leave --agg out")
    return apply_flags(cfg, {INFERENCE_FLAGS[flag]: (flag, value) for flag, value in values.items()})


def dump(cfg: dict) -> str:
    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None)
