"""The disk a training run needs, stated before it starts (``train.py`` and ``--probe-memory``), so a full scratch
disk or a quota is found at the start, not after hours.

    checkpoints   one checkpoint's bytes (the model's state dict, the optimizer's state: AdamW 2 float32 tensors per
                  trained parameter, SGD 1, and a little for the config, RNG states and history) times the files that
                  can hold different states at once: last.pt, best.pt, train.keep_last_k epoch files, and the one
                  being written (an atomic write keeps the old file until the new one is whole)
    logs          train.log, memory.csv and metrics.csv lines per logged step and per epoch, and the two plots
    feature bank  train.feature_bank: its copy beside each checkpoint, and with disk storage the live file

A run that fills the disk anyway stops at its first failed write with one line (``core.files.DiskFullError``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from config import Config
from core.files import free_bytes
from planner.estimate import MiB

log = logging.getLogger("longvideo")
CHECKPOINT_EXTRAS = 256 * 1024  # the config, class names, RNG states, history and the zip's own records
LOG_BYTES_PER_STEP = 600  # one train.log line (~200 bytes) and one memory.csv row (~400)
LOG_BYTES_PER_EPOCH = 1500  # the epoch's train.log lines and its metrics.csv row
PLOT_BYTES = 2 * 150 * 1024  # training_curves.png and confusion_matrix.png
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}  # state tensors per parameter a checkpoint holds (SGD: momentum)


@dataclass(frozen=True)
class DiskPlan:
    checkpoint: int  # bytes of one checkpoint
    checkpoints: int  # checkpoint files that can hold different states at once
    logs: int
    bank: int = 0  # train.feature_bank: its copy beside each checkpoint
    live_bank: int = 0  # train.feature_bank: disk, the live file in the run directory

    @property
    def total(self) -> int:
        return (self.checkpoint + self.bank) * self.checkpoints + self.logs + self.live_bank

    def text(self) -> str:
        bank = f" and its feature bank's copy of {self.bank / MiB:.1f} MB" if self.bank else ""
        live = f", the live feature bank's {self.live_bank / MiB:.1f} MB" if self.live_bank else ""
        return (
            f"{self.total / MiB:.0f} MB ({self.checkpoints} checkpoints of {self.checkpoint / MiB:.1f} MB{bank}, the "
            f"one being written included{live}, and {self.logs / MiB:.1f} MB of logs and plots)"
        )


def checkpoint_bytes(model: nn.Module, optimizer: str) -> int:
    """Bytes of a training checkpoint of ``model`` (on any device, the meta device too)."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return state + OPTIMIZER_STATES[optimizer] * trained * 4 + CHECKPOINT_EXTRAS


def disk_plan(cfg: Config, model: nn.Module, steps_per_epoch: int, bank_bytes: int = 0) -> DiskPlan:
    """``bank_bytes``: train.feature_bank's size (the run knows it once its training set is read)."""
    train, epochs = cfg.train, cfg.train.max_epochs
    logged_steps = epochs * math.ceil(steps_per_epoch / cfg.trainer.log_every)
    return DiskPlan(
        checkpoint_bytes(model, train.optimizer),
        train.keep_last_k + 3,
        logged_steps * LOG_BYTES_PER_STEP + epochs * LOG_BYTES_PER_EPOCH + PLOT_BYTES,
        bank_bytes,
        bank_bytes if train.feature_bank == "disk" else 0,
    )


def state_disk_plan(plan: DiskPlan, output_dir: str, out=None, written: int = 0) -> str | None:
    """One line stating the plan and the free space under ``output_dir`` (``out``, or the log at info level), and
    a warning line when it is short; returns the warning (None when it fits or is unknown). ``written``: bytes the
    run has written already (a resumed run's files), which the free space need not hold again."""
    free = free_bytes(output_dir)
    free_text = "free space unknown" if free is None else f"{free / MiB:.0f} MB free"
    if written:
        free_text += f"; {written / MiB:.0f} MB of it written already"
    (out or log.info)(f"disk: the run needs about {plan.text()} under {output_dir} ({free_text})")
    if free is None or plan.total - written <= free:
        return None
    warning = (
        f"disk: {output_dir} has {free / MiB:.0f} MB free, less than the {(plan.total - written) / MiB:.0f} MB "
        f"this run still needs: free space there, lower train.keep_last_k ({plan.checkpoints - 3}), or set "
        f"trainer.output_dir to a larger disk"
    )
    (out or log.warning)(warning)
    return warning


def bytes_written(folder: str) -> int:
    """The bytes of the files under ``folder``, each file once (best.pt and epoch files are hard links)."""
    seen, total = set(), 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                stat = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def model_on_meta(build) -> nn.Module:
    """``build()`` with its tensors on the meta device: sizes without memory."""
    with torch.device("meta"):
        return build()
