"""What a training step computes besides the forward: its loss (the label's, by clip or by chunk, plus the model's
auxiliary loss), and a loader batch split into the micro-batches the out-of-memory back-off asks for. train.py's
loop and the memory planner both use them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from config import TrainConfig
from core.errors import ConfigError
from engine.inference.chunks import aggregate_chunk_logits, chunk_labels, chunk_windows, clip_length
from engine.training.chunked_forward import ChunkSpec
from models.temporal import HeadOutput

# the keys of a batch (datasets/sample.py) a micro-batch split carries: the model's inputs and what the loss reads
MODEL_KEYS = ("label", "video", "kpt", "frame_labels", "features", "windows", "mask", "chunk_labels", "sample")
SMOOTHING_WEIGHT = 0.15  # MS-TCN's weight of its smoothing loss beside the cross-entropy of each stage


@dataclass(frozen=True)
class BatchLoss:
    """A loader batch's clip losses summed over its clips: the whole loss the optimizer minimizes, and the part of it
    that is the auxiliary loss (model.chunk_reconstruction's; 0 without one), so the label's loss can be told apart."""

    total: float = 0.0
    auxiliary: float = 0.0
    clips: int = 0


def micro_batches(batch: dict, splits: int) -> list[dict]:
    """A loader batch's model keys in ``splits`` non-empty pieces (the out-of-memory back-off's split)."""
    keys = [k for k in MODEL_KEYS if k in batch]
    return [
        dict(zip(keys, parts)) for parts in zip(*(torch.tensor_split(batch[k], splits) for k in keys)) if len(parts[0])
    ]


def clips_per_forward(batch_size: int, splits: int) -> int:
    return math.ceil(batch_size / splits)


def training_losses(
    outputs: HeadOutput, piece: dict, spec: ChunkSpec, train_cfg: TrainConfig, criterion: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the label's loss, the forward's weighted auxiliary loss or None): what the optimizer minimizes is their sum.
    ``outputs``: the training forward's (ChunkedTrainingForward's or FeatureHeadForward's) for the micro-batch
    ``piece``."""
    return label_loss(outputs, piece, spec, train_cfg, criterion), outputs.auxiliary


def label_loss(
    outputs: HeadOutput, piece: dict, spec: ChunkSpec, train_cfg: TrainConfig, criterion: torch.nn.Module
) -> torch.Tensor:
    """train.chunk_loss clip: the aggregated chunk logits (or a temporal head's clip logits) against the clip
    label (the plain loss for one chunk); dense: each chunk (a head's per-chunk logits) against the label
    covering most of its frames, chunks no segment covers left out, averaged over the chunks that count."""
    chunk_logits = outputs.chunks.transpose(0, 1)  # [n, B, K], as the chunk labels
    device = chunk_logits.device
    if train_cfg.chunk_loss == "clip":
        logits = (
            outputs.clip
            if outputs.clip is not None
            else aggregate_chunk_logits(chunk_logits, train_cfg.chunk_train_aggregation)
        )
        return criterion(logits, piece["label"].to(device, non_blocking=True))
    if "chunk_labels" in piece:  # whole videos of features: each chunk's label read with them
        labels = piece["chunk_labels"].t().to(device)  # [n, B]
    elif "frame_labels" in piece:
        chunks = chunk_windows(clip_length(piece), spec.size, spec.overlap)
        labels = chunk_labels(piece["frame_labels"], chunks).to(device)  # [n, B]
    else:
        raise ConfigError(
            "train.chunk_loss: dense needs the samples' frame_labels (the dataset provides them); use chunk_loss: clip"
        )
    counted = labels >= 0
    if not counted.any():  # no chunk of this piece lies in a segment: nothing to learn, no NaN either
        return chunk_logits.sum() * 0.0
    if outputs.stages is None:
        return criterion(chunk_logits[counted], labels[counted])
    stages = [stage.transpose(0, 1) for stage in outputs.stages]  # [n, B, K] each, as the labels
    real = (
        piece["mask"].t().to(device) if "mask" in piece else torch.ones(labels.shape, dtype=torch.bool, device=device)
    )
    return sum(
        criterion(stage[counted], labels[counted]) + SMOOTHING_WEIGHT * smoothing_loss(stage, real) for stage in stages
    )


def smoothing_loss(chunk_logits: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """MS-TCN's truncated MSE over neighbouring chunks' log-probabilities (clamped at 16, the earlier chunk's
    detached), over pairs of real chunks (``real`` [n, B]: False at padding): it penalizes over-segmentation, the
    flicker frame accuracy does not see. [n, B, K] logits."""
    log_probs = chunk_logits.float().log_softmax(dim=-1)
    squared = ((log_probs[1:] - log_probs[:-1].detach()) ** 2).clamp(max=16)  # [n - 1, B, K]
    pairs = real[1:] & real[:-1]
    if not pairs.any():
        return log_probs.sum() * 0.0
    return squared[pairs].mean()
