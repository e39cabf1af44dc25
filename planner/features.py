"""The memory of a run that trains a temporal head on features (``data.features_dir``): one training step over the
longest video's chunks at the run's batch, estimated as every run's step is (``planner.estimate``: fake tensors,
the head's parameters, gradients, AdamW state, the padded features batch, activations), stated before the run;
``data.batch_size: auto`` takes the largest batch whose estimate fits ``trainer.memory_budget_gb``."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from config import Config, apply_flags
from core.errors import ConfigError
from core.runtime import Runtime
from engine.training.chunked_forward import ChunkSpec, FeatureHeadForward
from engine.training.step import training_loss
from models import build_feature_head
from planner.estimate import StepEstimate, estimate_training_step, margin_text, usable_bytes
from planner.project import _largest

log = logging.getLogger("longvideo")


def feature_training_estimate(
    cfg: Config, feature_dim: int, chunks: int, batch: int, num_classes: int, precision: str | None = None
) -> StepEstimate:
    """One training step of the head over ``batch`` videos of ``chunks`` chunks (the longest: every batch is padded
    to its longest video)."""
    criterion = nn.CrossEntropyLoss()
    model_cfg = dataclasses.replace(cfg.model, temporal_head_init=None)
    # the loss on the clip logits: the dense one picks labelled chunks by value, which fake tensors do not have
    # (a [n, B, K] logits' worth of memory either way); every stage of a tcn is still in the graph
    loss_cfg = dataclasses.replace(cfg.train, chunk_loss="clip")

    def inputs() -> dict:
        return {
            "features": torch.zeros(batch, chunks, feature_dim),
            "windows": torch.zeros(batch, chunks, 2),
            "mask": torch.ones(batch, chunks, dtype=torch.bool),
            "chunk_labels": torch.zeros(batch, chunks, dtype=torch.long),
            "label": torch.zeros(batch, dtype=torch.long),
        }

    def loss(model, batch_inputs):
        return training_loss(
            FeatureHeadForward(model)(batch_inputs, ChunkSpec()), batch_inputs, ChunkSpec(), loss_cfg, criterion
        )

    return estimate_training_step(
        lambda: build_feature_head(model_cfg, feature_dim, num_classes).train(),
        inputs,
        loss,
        precision or cfg.trainer.precision,
        cfg.train.optimizer,
        cfg.train.accumulate_grad_batches,
    )


def plan_feature_training(cfg: Config, runtime: Runtime, num_classes: int, index: tuple) -> Config:
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
            return feature_training_estimate(cfg, source["feature_dim"], chunks, b, num_classes).peak

        batch = _largest(peak, usable, min(len(files), 1024))
        if not batch:
            raise ConfigError(
                f"one video of {chunks} chunks does not fit {margin_text(budget, cuda)}; raise "
                f"trainer.memory_budget_gb or use a smaller model.temporal_width"
            )
        cfg = apply_flags(cfg, {"data.batch_size": ("the memory planner (data.batch_size: auto)", batch)})
    estimate = feature_training_estimate(cfg, source["feature_dim"], chunks, batch, num_classes)
    fit = ""
    if usable is not None:
        fit = (
            f"; fits {margin_text(budget, cuda)}"
            if estimate.peak <= usable
            else f"; over {margin_text(budget, cuda)}: lower data.batch_size or model.temporal_width"
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
