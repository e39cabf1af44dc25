"""The optimizer, its schedule and the gradient clip."""

from __future__ import annotations

import math

import torch

from config import TrainConfig

SGD_MOMENTUM = 0.9  # train.optimizer: sgd, with Nesterov's momentum (torchvision's video recipe)


def build_optimizer(
    model: torch.nn.Module, train_cfg: TrainConfig, foreach: bool | None = None
) -> torch.optim.Optimizer:
    """No weight decay on norms and biases (the usual practice for CNNs and transformers). ``foreach``: torch's
    choice per device when None (the memory planner asks for CUDA's on the tensors it estimates with)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.dim() > 1], "weight_decay": train_cfg.weight_decay, "name": "model"},
        {"params": [p for p in trained if p.dim() <= 1], "weight_decay": 0.0, "name": "model"},
    ]
    if train_cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train_cfg.lr, momentum=SGD_MOMENTUM, nesterov=True, foreach=foreach)
    return torch.optim.AdamW(groups, lr=train_cfg.lr, foreach=foreach)


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


def build_scheduler(optimizer, train_cfg: TrainConfig, steps_per_epoch: int, has_temporal_head: bool = False):
    """Linear warm-up, then cosine decay to min_lr over train.max_epochs, stepped once per optimizer step."""
    warmup = int(round(warmup_epochs(train_cfg, has_temporal_head) * steps_per_epoch))
    floor = train_cfg.min_lr / train_cfg.lr if train_cfg.lr > 0 else 0.0
    total = max(1, steps_per_epoch * train_cfg.max_epochs)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
