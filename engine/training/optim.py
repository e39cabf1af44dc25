"""The optimizer (the temporal head's own parameter groups), its schedule and the gradient clip."""

from __future__ import annotations

import math

import torch

from config import TrainConfig
from models import temporal_head_of


def build_optimizer(model: torch.nn.Module, train_cfg: TrainConfig) -> torch.optim.Optimizer:
    """No weight decay on norms and biases (the usual practice for CNNs and transformers). A temporal head's
    parameters form groups of their own at train.lr x train.temporal_lr_scale (the schedule scales every group
    alike); without a head, or with a scale of 1, the model is one pair of groups, as before the scale existed."""

    def decay_groups(name: str, params: list, lr: float) -> list[dict]:
        return [
            {
                "params": [p for p in params if p.dim() > 1],
                "weight_decay": train_cfg.weight_decay,
                "lr": lr,
                "name": name,
            },
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": lr, "name": name},
        ]

    trained = [p for p in model.parameters() if p.requires_grad]
    head = temporal_head_of(model)
    in_head = set() if head is None else {id(p) for p in head.parameters()}
    # a head that is all that trains (trained alone on features, models.temporal.FeatureHead) has no backbone rate
    # to be scaled from: train.lr is its rate
    if head is None or train_cfg.temporal_lr_scale == 1.0 or all(id(p) in in_head for p in trained):
        groups = decay_groups("model", trained, train_cfg.lr)
    else:
        groups = decay_groups("model", [p for p in trained if id(p) not in in_head], train_cfg.lr) + decay_groups(
            "temporal head", [p for p in trained if id(p) in in_head], train_cfg.lr * train_cfg.temporal_lr_scale
        )
    if train_cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train_cfg.lr, momentum=train_cfg.momentum, nesterov=True)
    return torch.optim.AdamW(groups, lr=train_cfg.lr)


def max_grad_norm(train_cfg: TrainConfig, has_temporal_head: bool) -> float | None:
    """train.grad_clip, else train.temporal_grad_clip when the model has a temporal head."""
    if train_cfg.grad_clip is not None:
        return train_cfg.grad_clip
    return train_cfg.temporal_grad_clip if has_temporal_head else None


def warmup_epochs(train_cfg: TrainConfig, has_temporal_head: bool) -> float:
    """train.warmup_epochs, at least train.temporal_warmup_epochs when the model has a temporal head."""
    return (
        max(train_cfg.warmup_epochs, train_cfg.temporal_warmup_epochs) if has_temporal_head else train_cfg.warmup_epochs
    )


def build_scheduler(
    optimizer,
    train_cfg: TrainConfig,
    steps_per_epoch: int,
    max_epochs: int,
    has_temporal_head: bool = False,
    refit_epochs: int = 0,
):
    """Linear warm-up, then cosine decay to min_lr, stepped once per optimizer step. With ``refit_epochs``
    (train.temporal_refit_epochs) the schedule runs twice: over the epochs before them, then again, warm-up
    included, over theirs, for the new head."""
    warmup = int(round(warmup_epochs(train_cfg, has_temporal_head) * steps_per_epoch))
    floor = train_cfg.min_lr / train_cfg.lr if train_cfg.lr > 0 else 0.0
    refit_start = steps_per_epoch * (max_epochs - refit_epochs) if refit_epochs else None

    def phase(step: int, total: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def factor(step: int) -> float:
        if refit_start is None:
            return phase(step, max(1, steps_per_epoch * max_epochs))
        if step < refit_start:
            return phase(step, max(1, refit_start))
        return phase(step - refit_start, max(1, steps_per_epoch * refit_epochs))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
