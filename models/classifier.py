"""The one classifier shape every registered model takes: branches, view fusion, head."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.adapters import AdapterPoints, SideAdapters, build_adapters
from models.reconstruction import ChunkDecoder
from models.registry import ModelConfigError
from models.temporal import temporal_head


def batch_norm(channels: int, dims: int) -> nn.Module:
    """Every backbone is built with BatchNorm; model.norm swaps it afterwards (``models.norms.convert_norms``)."""
    return nn.BatchNorm3d(channels) if dims == 3 else nn.BatchNorm1d(channels)


@contextlib.contextmanager
def running_stats_frozen(module: nn.Module):
    """BatchNorm layers of ``module`` normalize with the batch statistics as usual but leave their running
    statistics as they were: the state of a recomputation, whose first forward already updated them once.

    Momentum 0 keeps the running mean and variance exactly (x * 1 + batch * 0) while the layer runs the same
    ops and saves the same tensors for backward as the first forward did (checkpointing checks that); the
    step counter, which the layer raises in Python, is put back afterwards.
    """
    norms = [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.training
    ]
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def recompute_in_backward(module: nn.Module, function, *args):
    """``function(*args)`` without keeping its activations: they are recomputed in backward.

    Non-reentrant ``torch.utils.checkpoint`` (works with inputs that need no grad, with autocast, nested, and
    under DDP), with the recomputation run under :func:`running_stats_frozen`: without it every checkpointed
    BatchNorm counted each step twice (``num_batches_tracked`` 2 after one step) and its running mean and
    variance moved twice as far as the momentum says. Dropout draws the same mask both times (the RNG state is
    replayed).
    """
    if torch.compiler.is_compiling():
        # torch.compile cannot trace a context_fn; it needs none: the compiled graph applies the BatchNorm's
        # running-stat updates once, in the forward, and its backward recomputes only what the gradients need
        return checkpoint(function, *args, use_reentrant=False)
    return checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), running_stats_frozen(module)),
    )


class StagedBackbone(nn.Module):
    """A backbone as a list of stages, so gradient checkpointing can recompute one stage at a time.

    Subclasses fill ``stages`` (nn.ModuleList) and set ``feature_dim`` and ``min_frames``.
    """

    feature_dim: int
    min_frames: int = 1

    def __init__(self):
        super().__init__()
        self.recompute_blocks = False

    def run_stages(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            if self.recompute_blocks and self.training and torch.is_grad_enabled():
                x = recompute_in_backward(stage, stage, x)
            else:
                x = stage(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.run_stages(x))

    def adapter_points(self) -> AdapterPoints | None:
        """Where model.adapter reads it: each stage's output, [B, C, T, H, W]."""
        return AdapterPoints(self.stages, "channels_first", (1, 3, max(8, self.min_frames), 64, 64))

    @staticmethod
    def pool(x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=tuple(range(2, x.dim())))


class VideoClassifier(nn.Module):
    """RGB backbone and/or keypoint branch, camera views fused, one linear head.

    view_fusion: none (a single view), mean (features averaged over views), concat (features
    concatenated; the view count is fixed at build time), late (one prediction per view, logits averaged).
    temporal: the temporal head's kind (model.temporal_head, models/temporal.py) or None; with a head, a clip's chunk
    features go through ``self.temporal`` (the chunked forwards of engine/inference/chunks.py do that) and
    ``forward`` treats its input as one chunk.
    reconstruction: the weight of the chunk reconstruction loss (models/reconstruction.py; 0: none), with a
    temporal head and an RGB backbone whose features train: ``self.reconstruction``, which the training forward runs.
    adapter: model.adapter (block, side or lora; models/adapters.py) or None: the RGB backbone frozen as with
    ``freeze_backbone``, ``self.adapters`` trained on it (None for lora, whose layers are inside the backbone).
    """

    def __init__(
        self,
        rgb: StagedBackbone | None,
        kpt: StagedBackbone | None,
        num_classes: int,
        view_fusion: str = "none",
        num_views: int = 1,
        temporal: str | None = None,
        freeze_backbone: bool = False,
        reconstruction: float = 0.0,
        adapter: str | None = None,
    ):
        super().__init__()
        if rgb is None and kpt is None:
            raise ModelConfigError("a classifier needs an RGB backbone, a keypoint branch, or both")
        if view_fusion == "none" and num_views > 1:
            raise ModelConfigError(
                f"the data has {num_views} camera views but model.view_fusion is none; "
                f"set model.view_fusion to mean, concat or late"
            )
        self.rgb, self.kpt = rgb, kpt
        adapter = adapter if rgb is not None else None
        self.frozen_backbone = (freeze_backbone or adapter is not None) and rgb is not None
        # the backbone's forward keeps a graph where the gradient reaches adapters through it (block, lora)
        self.backbone_without_graph = self.frozen_backbone and adapter in (None, "side")
        # model.freeze_backbone: no gradients, so no optimizer state (engine/training/optim.py)
        if self.frozen_backbone:
            rgb.requires_grad_(False)
        self.view_fusion, self.num_views = view_fusion, num_views
        rgb_dim = 0 if rgb is None else rgb.feature_dim * (num_views if view_fusion == "concat" else 1)
        kpt_dim = 0 if kpt is None else kpt.feature_dim
        self.feature_dim = rgb_dim + kpt_dim  # the branches' features concatenated
        # with a temporal head, the head's own classifier replaces this one (an unused one would stall DDP); a
        # Sequential whose second entry is the linear layer: the checkpoints' key (classifier.1.*)
        self.classifier = (
            nn.Sequential(nn.Identity(), nn.Linear(self.feature_dim, num_classes)) if temporal is None else None
        )
        self.min_frames = max(b.min_frames for b in (rgb, kpt) if b is not None)
        self.temporal = None
        if temporal is not None:
            if view_fusion == "late":
                raise ModelConfigError(
                    "model.temporal_head needs one feature vector per chunk, but view_fusion late "
                    "keeps one per view; use view_fusion mean or concat"
                )
            self.temporal = temporal_head(self.feature_dim, num_classes, temporal)
        self.adapter_kind = adapter
        # model.chunk_reconstruction: where chunk features reach a temporal head from an RGB backbone whose features
        # train; created after the rest, so a seed initializes every other layer as it did without it
        self.reconstruction = (
            ChunkDecoder(self.feature_dim, reconstruction)
            if reconstruction > 0 and self.temporal is not None and self.rgb_trains
            else None
        )
        # model.adapter: built last for the same reason
        self.adapters = None if adapter is None else build_adapters(rgb, adapter, rgb.feature_dim)

    @property
    def rgb_trains(self) -> bool:
        """Does the RGB branch's gradient reach something that trains: the backbone, or adapters on it frozen? (Not
        a backbone frozen by model.freeze_backbone alone.)"""
        return self.rgb is not None and (not self.frozen_backbone or self.adapter_kind is not None)

    def train(self, mode: bool = True) -> VideoClassifier:
        """A frozen backbone stays in eval mode: its BatchNorm normalizes with its pretrained statistics and never
        updates them, its dropout is off (the features it gives are the ones it was trained to give)."""
        super().train(mode)
        if self.frozen_backbone:
            self.rgb.eval()
            if mode and not self.backbone_without_graph:
                # block and LoRA adapters train through it: its checkpointing, which asks the training flag of the
                # unit that recomputes (the backbone, a transformers layer), stays on; their children stay in eval
                for unit in [self.rgb, *(m for m in self.rgb.modules() if hasattr(m, "gradient_checkpointing"))]:
                    unit.training = True
        return self

    def set_recompute_blocks(self, enabled: bool = True) -> None:
        for branch in (self.rgb, self.kpt):
            if branch is not None:
                branch.recompute_blocks = enabled

    def features(self, inputs: dict) -> torch.Tensor:
        """[B, D] features; [B, V, D] with late view fusion (one feature row per view)."""
        parts = []
        if self.rgb is not None:
            video = inputs["video"]
            if video.dim() == 5:
                video = video.unsqueeze(1)
            b, v = video.shape[:2]
            if self.view_fusion == "concat" and v != self.num_views:
                raise ValueError(f"view_fusion=concat was built for {self.num_views} views, got {v}")
            side = self.adapters if isinstance(self.adapters, SideAdapters) else None
            if side is not None:
                side.tapped.clear()  # what an earlier forward recorded and no correction read (a bare self.rgb call)
            with torch.no_grad() if self.backbone_without_graph else contextlib.nullcontext():  # no graph to keep
                per_view = self.rgb(video.flatten(0, 1))
            if side is not None:
                per_view = side(per_view)
            per_view = per_view.view(b, v, -1)
            if self.view_fusion == "late":
                parts.append(per_view)
            elif self.view_fusion == "concat":
                parts.append(per_view.flatten(1))
            else:
                parts.append(per_view.mean(dim=1))
        if self.kpt is not None:
            kpt_features = self.kpt(inputs["kpt"])
            if self.view_fusion == "late" and parts:
                kpt_features = kpt_features.unsqueeze(1).expand(-1, parts[0].shape[1], -1)
            parts.append(kpt_features)
        return torch.cat(parts, dim=-1)

    def classify(self, features: torch.Tensor) -> torch.Tensor:
        """The linear classifier's logits [B, K] of features [B, D] (late view fusion: [B, V, D], logits averaged)."""
        logits = self.classifier(features)
        return logits.mean(dim=1) if logits.dim() == 3 else logits

    def forward(self, inputs: dict) -> torch.Tensor:
        """Clip logits [B, K]; with a temporal head, of the clip as one chunk of stride 1."""
        features = self.features(inputs)
        if self.temporal is None:
            return self.classify(features)
        length = next(v.shape[-3] if k == "video" else v.shape[1] for k, v in inputs.items())
        return self.temporal(features.unsqueeze(1), torch.tensor([[0, length]])).clip
