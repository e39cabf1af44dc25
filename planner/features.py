"""The memory of a run that trains a temporal head on features (``data.features_dir``): one training step over the
longest video's chunks at the run's batch, estimated as every run's step is (``planner.estimate``: fake tensors,
the head's parameters, gradients, AdamW state, the padded features batch, activations), stated before the run;
``data.batch_size: auto`` takes the largest batch whose estimate fits ``trainer.memory_budget_gb``."""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import torch
from torch import nn

from config import Config, apply_flags
from core.errors import ConfigError
from core.runtime import Runtime
from engine.training.chunked_forward import ChunkSpec, FeatureHeadForward
from engine.training.optim import build_optimizer, max_grad_norm
from engine.training.step import training_losses
from models import build_feature_head
from planner.estimate import StepEstimate, estimate_training_step, margin_text, usable_bytes
from planner.project import LoopStep, _largest

log = logging.getLogger("longvideo")


def feature_training_estimate(
    cfg: Config,
    step: LoopStep,
    feature_dim: int,
    chunks: int,
    batch: int,
    num_classes: int,
    precision: str | None = None,
) -> StepEstimate:
    """One training step of the head over ``batch`` videos of ``chunks`` chunks (the longest: every batch is padded
    to its longest video): train.py's ``step``."""
    # the loss on the clip logits: the dense one picks labelled chunks by value, which fake tensors do not have
    # (a [n, B, K] logits' worth of memory either way); every stage of a tcn is still in the graph
    loss_cfg = dataclasses.replace(cfg.train, chunk_loss="clip")
    losses = partial(training_losses, train_cfg=loss_cfg, criterion=nn.CrossEntropyLoss())

    def inputs() -> dict:
        return {
            "features": torch.zeros(batch, chunks, feature_dim),
            "windows": torch.zeros(batch, chunks, 2),
            "mask": torch.ones(batch, chunks, dtype=torch.bool),
            "chunk_labels": torch.zeros(batch, chunks, dtype=torch.long),
            "label": torch.zeros(batch, dtype=torch.long),
        }

    def forward_backward(model, batch_inputs, runtime, scaler, weight):
        step.forward_backward(
            FeatureHeadForward(model), batch_inputs, batch_inputs, ChunkSpec(), losses, runtime, scaler, weight
        )

    def optimizer_step(model, optimizer, scaler):
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        step.optimizer_step(model, optimizer, scaler, schedule, max_grad_norm(cfg.train, True))

    return estimate_training_step(
        lambda: build_feature_head(cfg.model, feature_dim, num_classes).train(),
        inputs,
        lambda model: build_optimizer(model, cfg.train, foreach=True),
        forward_backward,
        optimizer_step,
        precision or cfg.trainer.precision,
        cfg.train.accumulate_grad_batches,
    )


def plan_feature_training(cfg: Config, runtime: Runtime, num_classes: int, index: tuple, step: LoopStep) -> Config:
    """The estimate of a features run stated (and with data.batch_size: auto, the batch chosen) from its files'
    ``index`` (``engine.data.feature_files.index_features``); returns the config that runs."""
    files, source = index
    chunks = max(header["chunks"] for _, header in files.values())
    budget, cuda = cfg.trainer.memory_budget_gb, runtime.device.type == "cuda"
    usable = usable_bytes(budget, cuda) if budget else None
    batch = cfg.data.batch_size
    if batch == "auto":
        if usable is None:
            raise ConfigError(
                "data.batch_size: auto fits trainer.memory_budget_gb, which is not set; set the budget, "
                "or a number of videos per step (1, as MS-TCN trains)"
            )

        def peak(b: int) -> int:
            return feature_training_estimate(cfg, step, source["feature_dim"], chunks, b, num_classes).peak

        batch = _largest(peak, usable, min(len(files), 1024))
        if not batch:
            raise ConfigError(
                f"one video of {chunks} chunks does not fit {margin_text(budget, cuda)}; raise "
                f"trainer.memory_budget_gb, or write fewer chunks a video (a longer infer_chunked.py --features "
                f"--chunk)"
            )
        cfg = apply_flags(cfg, {"data.batch_size": ("the memory planner (data.batch_size: auto)", batch)})
    estimate = feature_training_estimate(cfg, step, source["feature_dim"], chunks, batch, num_classes)
    fit = ""
    if usable is not None:
        fit = (
            f"; fits {margin_text(budget, cuda)}"
            if estimate.peak <= usable
            else f"; over {margin_text(budget, cuda)}: lower data.batch_size"
        )
    (log.warning if usable is not None and estimate.peak > usable else log.info)(
        "memory: a training step on features, batch %d padded to the longest video (%d chunks of %d features): "
        "estimated peak %.1f MiB (parameters %.1f, gradients %.1f, optimizer %.1f, inputs %.1f, activations %.1f)%s",
        batch,
        chunks,
        source["feature_dim"],
        estimate.peak / 2**20,
        estimate.parameters / 2**20,
        estimate.gradients / 2**20,
        estimate.optimizer_state / 2**20,
        estimate.inputs / 2**20,
        estimate.activations / 2**20,
        fit,
    )
    return cfg
