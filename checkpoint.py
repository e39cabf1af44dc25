"""Checkpoints: atomic writes, safe loads, and the one loader of a trained model for eval and inference.

Writes go to a temporary file in the same directory, are flushed and fsynced, then renamed over the
target: a job killed at any moment leaves either the old file or the new one, never a torn file.
Loads use ``torch.load(weights_only=True)``: a checkpoint that needs pickled code is refused (a cron job
must never run code that a file in a shared directory brings).
"""
from __future__ import annotations

import io
import os
import pickle
import random
import tempfile
import zipfile

import numpy as np
import torch

CHECKPOINT_FORMAT = 1  # bumped when the layout of the checkpoint dict changes


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, torn, unsafe, or from an incompatible config."""


def atomic_write_bytes(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def save_checkpoint(state: dict, path: str) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load_checkpoint(path: str, map_location="cpu") -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: refused: the file needs pickled code to load ({first}); only "
                              f"checkpoints of tensors and plain values are loaded (weights_only=True)")
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt?): {first}")
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a checkpoint of this project (no 'model' entry)")
    return state


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model under DDP and torch.compile, so state dicts have no module./_orig_mod. prefixes."""
    while True:
        if hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def rng_state() -> dict:
    numpy_state = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy_keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
        "numpy_pos": int(numpy_state[2]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_trained_model(path: str, device: torch.device):
    """(model in eval mode on ``device``, the checkpoint's config, class names, the checkpoint dict)."""
    from config import ConfigError, validate
    from models import build_model

    state = load_checkpoint(path)
    try:
        cfg = validate(state["config"])
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{path}: its config does not fit this version of the code: {e}")
    class_names = list(state["class_names"])
    # the trained weights replace any pretrained ones: do not fetch those again
    model_cfg = {**cfg["model"], "pretrained": None}
    try:
        model = build_model(model_cfg, num_classes=len(class_names), num_views=state.get("num_views", 1),
                            kpt_shape=tuple(state["kpt_shape"]) if state.get("kpt_shape") else None)
    except ValueError as e:
        raise CheckpointError(f"{path}: its model section cannot be built: {e}")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match model.backbone={cfg['model']['backbone']}: "
                              f"{str(e).splitlines()[0]}")
    return model.to(device).eval(), cfg, class_names, state
