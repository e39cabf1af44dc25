"""model.pretrained: weights for an RGB backbone from a local file, or torchvision's download.

torchvision's weight files load as they are (the backbones keep torchvision's module names under ``net``);
a checkpoint of this project works too (its ``rgb.`` weights are taken). The classifier of the file is left out:
the head is sized by model.model_class_num and trained from scratch.
"""

from __future__ import annotations

import logging
import os

import torch

from core.tensor_files import UnreadableFile, UnsafeFile, load_tensors
from models.registry import ModelConfigError

log = logging.getLogger("longvideo.models")
CLASSIFIER_PREFIXES = ("fc.", "head.", "classifier.")


class PretrainedError(ModelConfigError):
    pass


TORCHVISION_NAMES = {True: "DEFAULT", "kinetics400": "KINETICS400_V1"}  # model.pretrained -> the weights' name


def _download(name: str, spec) -> dict:
    """torchvision's weights of backbone ``name`` (``spec``: true or a name of config's NAMED_WEIGHTS), read from
    torch's hub cache, else downloaded into it once."""
    from torchvision.models import get_model_weights  # imported when asked for: it loads torch's compiler

    try:
        weights = getattr(get_model_weights(name), TORCHVISION_NAMES[spec])
    except (ValueError, KeyError, AttributeError):
        raise PretrainedError(
            f"model.pretrained: {_said(spec)}: torchvision has no such weights for {name}; give a weights file path"
        )
    try:
        return weights.get_state_dict(progress=False)
    except Exception as e:  # no network, a proxy, a full disk: all end here
        cache = os.path.join(torch.hub.get_dir(), "checkpoints")
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise PretrainedError(
            f"model.pretrained: {_said(spec)}: could not download torchvision's {name} weights ({reason}); "
            f"fetch {weights.url} on a machine with network and put it in {cache}/ here (read from there "
            f"without network)"
        )


def _said(spec) -> str:
    return "true" if spec is True else str(spec)


def _hub_weights(backbone: torch.nn.Module, name: str) -> dict:
    """model.pretrained: true for timm/... and hf/...: the library's own pretrained weights (timm's hub, the
    Hugging Face hub or its cache, or an hf/ directory's saved weights)."""
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry lines: the one line below says it all
    try:
        return backbone.load_hub_weights()
    except Exception as e:  # no network, no such weights, a full disk: all end here, in one line
        raise PretrainedError(
            f"model.pretrained: true: could not get {name}'s pretrained weights ({str(e).splitlines()[0][:200]}); "
            f"fetch them on a machine with network and set model.pretrained: /path/to/the weights file "
            f"(.pth, .bin or .safetensors)"
        )
    finally:
        hub_log.setLevel(level)


def _read_safetensors(path: str) -> dict:
    from safetensors.torch import load_file  # comes with timm and transformers, the files' usual producers

    try:
        return load_file(path)
    except Exception as e:  # a truncated or foreign file: safetensors' own error types vary by version
        raise PretrainedError(f"model.pretrained: {path}: not a readable .safetensors file ({e})")


def _read(path: str) -> dict:
    if path.endswith(".safetensors") and os.path.exists(path):
        return _read_safetensors(path)
    if not os.path.exists(path):
        raise PretrainedError(
            f"model.pretrained: {path}: file not found; give a weights file that exists, true for "
            f"torchvision's download, or null"
        )
    try:
        state = load_tensors(path)
    except (UnsafeFile, UnreadableFile) as e:
        raise PretrainedError(
            f"model.pretrained: {path}: not a weights file that loads with weights_only=True "
            f"({e}); give a state dict of tensors (torchvision's .pth files or a checkpoint of "
            f"this project), or null"
        )
    if isinstance(state, dict) and isinstance(state.get("model"), dict):  # a checkpoint of this project
        state = state["model"]
    if not isinstance(state, dict):
        raise PretrainedError(f"model.pretrained: {path}: expected a state dict, got {type(state).__name__}")
    if any(k.startswith("rgb.") for k in state):  # a classifier of this project: its RGB backbone
        state = {k[len("rgb.") :]: v for k, v in state.items() if k.startswith("rgb.")}
        state = {k[len("net.") :] if k.startswith("net.") else k: v for k, v in state.items()}
    return state


def load_pretrained(backbone: torch.nn.Module, spec, name: str, norm: str = "batch") -> None:
    """Weights into ``backbone`` (after model.norm's conversion: frozen and sync keep BatchNorm's keys)."""
    if spec is True and hasattr(backbone, "load_hub_weights"):
        state = _hub_weights(backbone, name)
    elif spec in TORCHVISION_NAMES:
        state = _download(name, spec)
    else:
        state = _read(spec)
    target = getattr(backbone, "net", backbone)  # torchvision's module under its own names
    state = {k: v for k, v in state.items() if not k.startswith(CLASSIFIER_PREFIXES)}
    statistics = [k for k in state if k.endswith("running_mean")]
    if norm == "group" and statistics:
        # GroupNorm's weight and bias have BatchNorm's shapes: without this they would load, statistics dropped
        raise PretrainedError(
            f"model.pretrained: {spec}: holds BatchNorm statistics ({statistics[0]}, ...), which "
            f"model.norm: group has no place for; use norm: frozen (or batch) to fine-tune these "
            f"weights, or model.pretrained: null to train GroupNorm from scratch"
        )
    own = target.state_dict()
    mismatched = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    if mismatched:
        raise PretrainedError(
            f"model.pretrained: {_said(spec)}: shapes differ from {name} "
            f"for {mismatched[:3]}; are these weights of another model?"
        )
    # counted by name: load_state_dict does not report a BatchNorm's num_batches_tracked as missing
    loaded = len([k for k in state if k in own])
    missing, unexpected = target.load_state_dict(state, strict=False)
    if loaded == 0:
        raise PretrainedError(
            f"model.pretrained: {_said(spec)}: no weight matches the "
            f"layers of {name}; are these weights of another model?"
        )
    log.info(
        "pretrained %s: %d of %d tensors loaded (%d not in the file, %d of the file unused)",
        name,
        loaded,
        len(own),
        len(missing),
        len(unexpected),
    )
