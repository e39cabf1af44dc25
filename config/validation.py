"""Validation: each value against its key's type and range, then the checks across keys. One error line names
the file (or ``--set``, or the flag), the key, what is wrong and how to fix it."""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

from config.keys import Key
from config.schema import (
    BACKBONES,
    DEFAULT_NORMALIZATION,
    EXTERNAL_BACKBONES,
    NAMED_WEIGHTS,
    SCHEMA,
    Config,
    did_you_mean,
)
from core.errors import ConfigError
from core.runtime import PRECISION_ALIASES


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
        if value is False and "off" in spec.choices:  # YAML reads a bare off as false
            value = "off"
        if value not in spec.choices:
            names = ", ".join(str(c).lower() if isinstance(c, bool) else c for c in spec.choices)
            raise ConfigError(f"{where}: {value!r} is not one of {names}")
    elif kind == "list":
        if not isinstance(value, list):
            fail("a list such as [a, b]")
    elif kind == "size":
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return [value, value]
        if (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
        ):
            return list(value)
        fail("a positive integer or [height, width]")
    elif kind == "precision":
        normal = PRECISION_ALIASES.get(str(value).lower())
        if normal is None:
            raise ConfigError(f"{where}: {value!r} is not one of 32, 16, bf16, 16-mixed, bf16-mixed, amp")
        return normal
    return value


def _in_range(spec: Key, value) -> bool:
    return (spec.minimum is None or value >= spec.minimum) and (spec.maximum is None or value <= spec.maximum)


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
                raise ConfigError(f"{origin(dotted)}: unknown key '{dotted}'{did_you_mean(dotted)}")
            spec = schema[key]
            if isinstance(spec, dict):
                if not isinstance(node[key], dict):
                    raise ConfigError(f"{origin(dotted)}: {dotted} must be a section (a mapping), got {node[key]!r}")
                walk(node[key], spec, dotted + ".")
            else:
                node[key] = _check_value(spec, node[key], f"{origin(dotted)}: {dotted}")

    walk(cfg, SCHEMA, "")
    _cross_checks(cfg, origin)
    return cfg


def _normalization(model: dict, data: dict, origin: Callable[[str], str]) -> None:
    """model.pretrained's form; data.mean and data.std left null: the named weights' normalization, else the
    default one."""
    pretrained, backbone = model["pretrained"], model["backbone"]
    if not (pretrained is None or pretrained is True or (isinstance(pretrained, str) and pretrained)):
        raise ConfigError(
            f"{origin('model.pretrained')}: model.pretrained must be null, {', '.join(NAMED_WEIGHTS)}, true, or a "
            f"weights file path, got {pretrained!r}"
        )
    by_backbone = NAMED_WEIGHTS.get(pretrained) if isinstance(pretrained, str) else None
    if by_backbone is not None and backbone not in by_backbone:
        raise ConfigError(
            f"{origin('model.pretrained')}: model.pretrained: {pretrained}: torchvision has these weights for "
            f"{', '.join(by_backbone)}, not for model.backbone: {backbone}; give a weights file, or null"
        )
    if pretrained is True:  # torchvision's default weights of a video backbone are its Kinetics-400 ones
        by_backbone = next((w for w in NAMED_WEIGHTS.values() if backbone in w), None)
    normalization = by_backbone[backbone] if by_backbone else DEFAULT_NORMALIZATION
    for name in ("mean", "std"):
        if data[name] is None:
            data[name] = list(normalization[name])


def _augmentation_checks(data: dict, origin: Callable[[str], str]) -> None:
    for key in ("flip_label_pairs", "kpt_flip_pairs"):
        pairs = data[key]
        if pairs is not None and not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise ConfigError(
                f"{origin('data.' + key)}: data.{key} must be a list of pairs such as [[a, b], [c, d]], got {pairs!r}"
            )
    pairs = data["kpt_flip_pairs"] or []
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for p in pairs for v in p):
        raise ConfigError(
            f"{origin('data.kpt_flip_pairs')}: data.kpt_flip_pairs holds joint indices (integers from "
            f"0), got {data['kpt_flip_pairs']!r}"
        )
    names = data["class_names"]
    for pair in data["flip_label_pairs"] or []:
        unknown = [str(v) for v in pair if names is not None and str(v) not in map(str, names)]
        if unknown:
            raise ConfigError(
                f"{origin('data.flip_label_pairs')}: data.flip_label_pairs names {', '.join(unknown)}, "
                f"not in data.class_names"
            )
    if data["augment"] and data["flip"] and data["load_kpt"] and data["kpt_flip_pairs"] is None:
        raise ConfigError(
            f"{origin('data.augment')}: a horizontal flip must swap left and right joints of the "
            f"keypoints: set data.kpt_flip_pairs (joint index pairs, e.g. [[1, 2], [3, 4]]; [] if no "
            f"joint has a side), or data.flip: false"
        )


def _temporal_head_checks(cfg: dict, origin: Callable[[str], str]) -> None:
    """A temporal head is the aggregation: the settings that would aggregate otherwise must not contradict it."""
    model, infer = cfg["model"], cfg["infer"]
    if infer["chunk_aggregation"] == "last":
        raise ConfigError(
            f"{origin('infer.chunk_aggregation')}: infer.chunk_aggregation: last runs only the last "
            f"chunk, but model.temporal_head={model['temporal_head']} needs every chunk's features (the "
            f"head is the aggregation); use mean (ignored with a head)"
        )
    if model["view_fusion"] == "late":
        raise ConfigError(
            f"{origin('model.view_fusion')}: model.view_fusion: late keeps one feature vector per view, "
            f"but model.temporal_head needs one per chunk; use mean or concat"
        )
    if infer["head_chunks"] == 0:
        raise ConfigError(
            f"{origin('infer.head_chunks')}: infer.head_chunks: 0 chunks cannot hold a chunk; "
            f"give a number of chunks, -1 (the whole video) or auto (the head's longest training clip)"
        )


def _norm_checks(cfg: dict, origin: Callable[[str], str]) -> None:
    """model.norm against the weights it starts from and train.precise_bn_batches."""
    model, norm = cfg["model"], cfg["model"]["norm"]
    if norm == "frozen" and model["pretrained"] is None:
        raise ConfigError(
            f"{origin('model.norm')}: model.norm: frozen keeps the BatchNorm statistics of pretrained "
            f"weights, but model.pretrained is null (they would stay mean 0, variance 1: no "
            f"normalization); set model.pretrained (kinetics400, true or a weights file), or use norm: group to "
            f"train from scratch"
        )
    if norm == "frozen" and model["input_type"] != "rgb":
        raise ConfigError(
            f"{origin('model.norm')}: model.norm: frozen needs pretrained statistics in every branch, "
            f"and the keypoint branch of input_type {model['input_type']} has none (model.pretrained "
            f"loads the RGB backbone); use norm: group, sync or batch"
        )
    if model["freeze_backbone"] and model["input_type"] == "kpt":
        raise ConfigError(
            f"{origin('model.freeze_backbone')}: model.freeze_backbone freezes the RGB backbone, and model.input_type "
            f"kpt has none; set it to false (the keypoint branch always trains)"
        )
    if model["adapter"] != "none" and model["input_type"] == "kpt":
        raise ConfigError(
            f"{origin('model.adapter')}: model.adapter adapts a frozen RGB backbone, and model.input_type kpt has "
            f"none; set it to none (the keypoint branch always trains)"
        )
    if model["adapter"] == "lora" and importlib.util.find_spec("peft") is None:
        raise ConfigError(
            f"{origin('model.adapter')}: model.adapter: lora needs the peft package, not installed here; "
            f"pip install -r requirements-backbones.txt, or use model.adapter: block or side"
        )
    if norm == "group" and (model["pretrained"] is True or model["pretrained"] in NAMED_WEIGHTS):
        raise ConfigError(
            f"{origin('model.norm')}: model.norm: group replaces BatchNorm, whose statistics "
            f"torchvision's pretrained weights (model.pretrained: true) hold; use norm: frozen (or "
            f"batch) to fine-tune them, or model.pretrained: null to train GroupNorm from scratch"
        )
    if cfg["train"]["precise_bn_batches"] and norm in ("frozen", "group"):
        raise ConfigError(
            f"{origin('train.precise_bn_batches')}: train.precise_bn_batches recomputes BatchNorm "
            f"statistics, but model.norm: {norm} "
            f"{'keeps them fixed' if norm == 'frozen' else 'has none'}; set precise_bn_batches: 0, or "
            f"norm: batch or sync"
        )


def _feature_bank_checks(train: dict, data: dict, origin: Callable[[str], str]) -> None:
    """train.feature_bank serves chunks without a gradient, from a grid each sample keeps every epoch."""
    refusals = (
        (
            train["grad_chunks"] == "all",
            "serves the chunks without a gradient, and train.grad_chunks is all (every chunk has one); set "
            "grad_chunks (e.g. 4)",
        ),
        (
            data["augment"],
            "needs each training sample to be the same frames every epoch, but data.augment is on (random crop, "
            "flip, colour jitter); set data.augment: false",
        ),
        (
            data["num_frames"] == -1,
            "needs one chunk grid for every sample, but data.num_frames is -1 (clips as long as their windows); "
            "set data.num_frames",
        ),
        (
            data["features_dir"],
            "keeps a backbone's chunk features, and data.features_dir trains on features already written (no "
            "backbone in the step); train on the videos (data.features_dir: null)",
        ),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{origin('train.feature_bank')}: train.feature_bank {why}, or feature_bank: off")


def _cross_checks(cfg: dict, origin: Callable[[str], str]) -> None:
    data, train, model = cfg["data"], cfg["train"], cfg["model"]
    chunk, overlap = cfg["infer"]["chunk_size"], cfg["infer"]["chunk_overlap"]
    if chunk != -1 and overlap >= chunk:
        raise ConfigError(
            f"{origin('infer.chunk_overlap')}: infer.chunk_overlap={overlap} must be smaller than "
            f"infer.chunk_size={chunk} (or set chunk_size: -1 for no chunking)"
        )
    chunk, overlap = train["chunk_train_size"], train["chunk_train_overlap"]
    if chunk != -1 and overlap >= chunk:
        raise ConfigError(
            f"{origin('train.chunk_train_overlap')}: train.chunk_train_overlap={overlap} must be smaller "
            f"than train.chunk_train_size={chunk} (or set chunk_train_size: -1 for no chunking)"
        )
    if train["grad_chunks"] != "all" and chunk == -1 and not data["features_dir"]:
        raise ConfigError(
            f"{origin('train.grad_chunks')}: train.grad_chunks={train['grad_chunks']} draws training chunks, but "
            f"train.chunk_train_size is -1 (the whole clip is one chunk); set chunk_train_size (e.g. 32), or "
            f"grad_chunks: all"
        )
    if train["feature_bank"] != "off":
        _feature_bank_checks(train, data, origin)
    if model["temporal_head"] != "none":
        _temporal_head_checks(cfg, origin)
    _norm_checks(cfg, origin)
    if data["batch_size"] == "auto" and not cfg["trainer"]["memory_budget_gb"]:
        raise ConfigError(
            f"{origin('data.batch_size')}: data.batch_size: auto needs trainer.memory_budget_gb (the "
            f"memory to fit, in GiB); set it, or give a number"
        )
    window, window_overlap = data["max_video_frames"], data["sample_window_overlap"]
    if window is not None and window_overlap >= window:
        raise ConfigError(
            f"{origin('data.sample_window_overlap')}: data.sample_window_overlap={window_overlap} "
            f"must be smaller than data.max_video_frames={window}"
        )
    if cfg["trainer"]["tensorboard"] is True and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            f"{origin('trainer.tensorboard')}: trainer.tensorboard: true needs the tensorboard package, which is not "
            f"installed; pip install tensorboard, or set trainer.tensorboard: auto"
        )
    if data["decoder"] == "pyav" and data["load_rgb"] and importlib.util.find_spec("av") is None:
        raise ConfigError(
            f"{origin('data.decoder')}: data.decoder: pyav needs PyAV, which is not installed; "
            f"pip install av, or set data.decoder: opencv"
        )
    needs_rgb = model["input_type"] in ("rgb", "rgb_kpt")
    needs_kpt = model["input_type"] in ("kpt", "rgb_kpt")
    if needs_rgb and not data["load_rgb"]:
        raise ConfigError(
            f"{origin('model.input_type')}: model.input_type={model['input_type']} needs frames; "
            f"set data.load_rgb: true"
        )
    if needs_kpt and not data["load_kpt"]:
        raise ConfigError(
            f"{origin('model.input_type')}: model.input_type={model['input_type']} needs keypoints; "
            f"set data.load_kpt: true"
        )
    _augmentation_checks(data, origin)
    _normalization(model, data, origin)
    for name in ("mean", "std"):
        values = data[name]
        if len(values) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{origin('data.' + name)}: data.{name} must be three numbers (R, G, B), got {values!r}")
    if any(v <= 0 for v in data["std"]):
        raise ConfigError(f"{origin('data.std')}: data.std must be positive, got {data['std']!r}")
    if train["min_lr"] > train["lr"]:
        raise ConfigError(
            f"{origin('train.min_lr')}: train.min_lr={train['min_lr']:g} must not exceed train.lr={train['lr']:g}"
        )
    names = data["class_names"]
    if names is not None and len(set(map(str, names))) != len(names):
        raise ConfigError(f"{origin('data.class_names')}: data.class_names has duplicates: {names!r}")
    device = cfg["trainer"]["device"]
    if not (device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ConfigError(
            f"{origin('trainer.device')}: trainer.device: {device!r} is not one of auto, cpu, cuda, cuda:N"
        )
    backbone = model["backbone"]
    if backbone.startswith(tuple(EXTERNAL_BACKBONES)):
        missing = external_package_missing(backbone)
        if missing:
            raise ConfigError(f"{origin('model.backbone')}: {missing}")
    elif backbone not in BACKBONES:
        raise ConfigError(
            f"{origin('model.backbone')}: model.backbone: unknown model '{model['backbone']}'; "
            f"known: {', '.join(sorted(BACKBONES))}"
        )


def external_package_missing(backbone: str) -> str | None:
    """Why ``model.backbone`` (timm/..., hf/...) cannot be built here: its name is empty or its optional package is
    not installed; None when it can be tried."""
    prefix = next(p for p in EXTERNAL_BACKBONES if backbone.startswith(p))
    package = EXTERNAL_BACKBONES[prefix]
    if backbone == prefix:
        return f"model.backbone: {backbone} names no model; e.g. {prefix}{'resnet18' if package == 'timm' else 'DIR'}"
    if importlib.util.find_spec(package) is None:
        return (
            f"model.backbone: {backbone} needs the {package} package, which is not installed: pip install -r "
            f"requirements-backbones.txt (or pip install {package})"
        )
    return None


def apply_flags(cfg: Config, flags: dict) -> Config:
    """A validated copy of ``cfg`` with command-line flags applied: ``{"infer.chunk_overlap": ("--overlap", 8)}``
    (a value of None leaves the key as it is). Errors name the flag, as --set's name --set."""
    return _changed(
        cfg,
        {dotted: value for dotted, (_, value) in flags.items() if value is not None},
        {dotted: flag for dotted, (flag, value) in flags.items() if value is not None},
    )


def derive(cfg: Config, changes: dict[str, Any], why: str) -> Config:
    """A validated copy of ``cfg`` with ``{"model.recompute_blocks": True, ...}`` changed: the one way code
    builds a config from another (the planner's alternatives, the precision a run resolved, a head with its
    backbone's settings). A change the checks refuse is a ConfigError naming the key and ``why`` it was made."""
    return _changed(cfg, changes, {dotted: why for dotted in changes})


def _changed(cfg: Config, changes: dict[str, Any], origins: dict[str, str]) -> Config:
    values = cfg.to_dict()
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        if section not in values or key not in values[section]:
            raise ConfigError(f"{origins[dotted]}: unknown key '{dotted}'{did_you_mean(dotted)}")
        values[section][key] = value
    return Config.from_dict(validate(values, origins))
