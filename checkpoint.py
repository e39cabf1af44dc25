"""Checkpoints: atomic writes, safe loads, and the one loader of a trained model for eval and inference.

Writes go through ``atomic_files``: a temporary file in the same directory, flushed and fsynced, then renamed
over the target: a job killed at any moment leaves either the old file or the new one, never a torn file.
Loads use ``torch.load(weights_only=True)``: a checkpoint that needs pickled code is refused (a cron job
must never run code that a file in a shared directory brings).
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import random
import re
import time
import zipfile
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from atomic_files import atomic_link, atomic_open

CHECKPOINT_FORMAT = 1  # bumped when the layout of the checkpoint dict changes
log = logging.getLogger("longvideo")


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, torn, unsafe, or from an incompatible config."""


@dataclass
class TrainState:
    epoch: int = 0  # the epoch being trained (0-based)
    batches_done: int = 0  # micro-batches of this epoch already trained (for a mid-epoch resume)
    global_step: int = 0  # optimizer steps so far
    best_metric: float = -math.inf
    skipped_steps: int = 0
    nonfinite_streak: int = 0
    micro_splits: int = 1  # forward passes per loader batch: doubled after each out-of-memory error
    history: list = field(default_factory=list)
    chunk_train_size: int | None = None  # training chunk length set by the OOM back-off; None = the config's
    epoch_loss_sum: float = 0.0  # summed clip losses of this epoch so far: a resumed epoch reports the whole
    epoch_clips: int = 0  # epoch's train_loss, not only the part after the resume

    @classmethod
    def from_checkpoint(cls, ckpt: dict) -> "TrainState":
        """By field name, so adding a field cannot shift the others; fields an older checkpoint lacks keep
        their defaults. The non-finite streak starts again at 0."""
        names = {f.name for f in fields(cls)} - {"nonfinite_streak"}
        return cls(**{name: ckpt[name] for name in names if name in ckpt})


def training_checkpoint(model, optimizer, scheduler, scaler, state: TrainState, cfg: dict, class_names: list,
                        data_info: dict) -> dict:
    """What a training checkpoint holds: the unwrapped model, optimizer, scheduler and scaler, the training state
    by field name (``TrainState.from_checkpoint`` reads it back the same way), the config, the class names, the
    RNG states and the data's shape (views, keypoints)."""
    progress = {f.name: getattr(state, f.name) for f in fields(TrainState) if f.name != "nonfinite_streak"}
    return {"format": CHECKPOINT_FORMAT, "model": unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            **progress, "config": cfg, "class_names": class_names, "rng": rng_state(), **data_info}


def save_epoch_links(run_dir: str, epoch: int, improved: bool, keep_last_k: int) -> None:
    """best.pt (when the monitored metric improved) and epoch_NNNN.pt as links to the last.pt just written: the
    state is serialized once an epoch, not up to three times. The oldest epoch files beyond keep_last_k go."""
    directory = os.path.join(run_dir, "checkpoints")
    last = os.path.join(directory, "last.pt")
    if improved:
        atomic_link(last, os.path.join(directory, "best.pt"))
    if keep_last_k > 0:
        atomic_link(last, os.path.join(directory, f"epoch_{epoch:04d}.pt"))
        epochs = sorted(n for n in os.listdir(directory) if n.startswith("epoch_") and n.endswith(".pt"))
        for name in epochs[:-keep_last_k]:
            os.unlink(os.path.join(directory, name))


def restore_training(path: str, model, optimizer, scheduler, scaler) -> tuple[TrainState, dict, str | None]:
    """The training state of a checkpoint, and its run directory (None when it lies outside one)."""
    ckpt = load_checkpoint(path)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    state = TrainState.from_checkpoint(ckpt)
    folder = os.path.dirname(os.path.realpath(path))
    run_dir = os.path.dirname(folder)
    if os.path.basename(folder) != "checkpoints" or not os.path.isfile(os.path.join(run_dir, "config.yaml")):
        run_dir = None
    log.info("resumed from %s: epoch %d, step %d", path, state.epoch + 1, state.global_step)
    return state, ckpt["rng"], run_dir


def save_checkpoint(state: dict, path: str) -> None:
    with atomic_open(path) as f:
        torch.save(state, f)  # straight into the temporary file: no second copy of the state in host memory


def make_run_dir(cfg: dict) -> str:
    """runs/<experiment>/<timestamp>/checkpoints, a new directory. ``latest`` moves to it with its first
    checkpoint (``point_latest_to``): a run killed before saving anything never becomes the latest."""
    experiment_dir = os.path.join(cfg["trainer"]["output_dir"], cfg["experiment"])
    run_dir = os.path.join(experiment_dir, time.strftime("%Y%m%d-%H%M%S"))
    suffix = 1
    while os.path.exists(run_dir):
        run_dir = os.path.join(experiment_dir, time.strftime("%Y%m%d-%H%M%S") + f"-{suffix}")
        suffix += 1
    os.makedirs(os.path.join(run_dir, "checkpoints"))
    return run_dir


def point_latest_to(run_dir: str) -> None:
    """runs/<experiment>/latest -> this run, replaced atomically (readers see the old or the new run)."""
    run_dir = os.path.realpath(run_dir)  # a run resumed through the "latest" link itself
    link = os.path.join(os.path.dirname(run_dir), "latest")
    target = os.path.basename(run_dir)
    if os.path.islink(link) and os.readlink(link) == target:
        return
    tmp_link = f"{link}.tmp{os.getpid()}"
    os.symlink(target, tmp_link)
    os.replace(tmp_link, link)


def load_checkpoint(path: str, map_location="cpu") -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: the file needs pickled code to load ({error_summary(e)}); only "
                              f"checkpoints of tensors and plain values are loaded (weights_only=True): use a "
                              f"checkpoint written by this project's train.py")
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        first = error_summary(e)
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt?): {first}; use another "
                              f"checkpoint of the run (last.pt, best.pt, epoch_N.pt)")
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a checkpoint of this project (no 'model' entry)")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, but this code reads format "
                              f"{CHECKPOINT_FORMAT}; use the version of this project that wrote it")
    return state


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def error_summary(error: Exception) -> str:
    """One line of a load error, for messages and files: the unpickler's own reason where torch gives one
    (never torch's advice to retry with weights_only=False, which would run the file's code), no terminal
    colour codes."""
    text = ANSI_ESCAPE.sub("", str(error)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = next((line for line in lines if "Unsupported global" in line or "WeightsUnpickler error" in line), None)
    if reason is None:
        reason = next((line for line in lines if "weights_only" not in line), lines[0] if lines else "")
    reason = reason.replace("WeightsUnpickler error: ", "")
    return reason or type(error).__name__


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
    from config import ConfigError, saved_config
    from models import ModelConfigError, build_model

    state = load_checkpoint(path)
    try:
        cfg = saved_config(state["config"])
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{path}: its config does not fit this version of the code: {e}")
    class_names = list(state["class_names"])
    # the trained weights replace any pretrained ones: do not fetch those again
    model_cfg = {**cfg["model"], "pretrained": None}
    try:
        model = build_model(model_cfg, num_classes=len(class_names), num_views=state.get("num_views", 1),
                            kpt_shape=tuple(state["kpt_shape"]) if state.get("kpt_shape") else None)
    except ModelConfigError as e:
        raise CheckpointError(f"{path}: its model section cannot be built: {e}")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match model.backbone={cfg['model']['backbone']}: "
                              f"{str(e).splitlines()[0]}")
    return model.to(device).eval(), cfg, class_names, state
