"""The training step: forward and backward of a micro-batch in its training chunks, gradient accumulation, the
optimizer step, and the out-of-memory back-off. Used by the loop (``loop``) and by the memory planner, which runs
``step_loss`` on fake tensors.

``Trainer`` (trainer.py) is what every step needs; the out-of-memory back-off is oom.py's, the optimizer optim.py's
(all in engine/training/).
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass

import torch

from config import TrainConfig
from core.errors import ConfigError
from datasets.sample import Sample
from engine.inference.chunks import aggregate_chunk_logits, chunk_labels, chunk_windows, clip_length
from engine.training.chunked_forward import ChunkSpec
from engine.training.feature_bank import FeatureBank
from engine.training.oom import (
    OutOfMemoryAdvice,
    OutOfMemoryError,
    SyncedOutOfMemory,
    agree_and_reduce,
    back_off_after_oom,
    save_memory_snapshot,
)
from engine.training.optim import max_grad_norm
from engine.training.trainer import Trainer
from models.temporal import HeadOutput

log = logging.getLogger("longvideo")


@dataclass(frozen=True)
class BatchLoss:
    """A loader batch's clip losses summed over its clips: the whole loss the optimizer minimizes, and the part of it
    that is the auxiliary loss (model.chunk_reconstruction's; 0 without one), so the label's loss can be told apart."""

    total: float = 0.0
    auxiliary: float = 0.0
    clips: int = 0


def train_batch(trainer: Trainer, group: list[dict], group_size: int, need_update: bool) -> BatchLoss:
    """The newest loader batch of an accumulation group through forward and backward (with the OOM back-off);
    at the group's end under DDP, every rank's back-off agreed and the gradients averaged (``agree_and_reduce``),
    so the optimizer step that follows is the same on every rank."""
    result = BatchLoss()
    if trainer.pending_advice is None:  # a rank that could back off no further sits out the rest of its group
        try:
            result = accumulate_with_oom_backoff(trainer, group, group_size, need_update)
        except OutOfMemoryAdvice as advice:
            if not trainer.runtime.distributed or isinstance(advice, SyncedOutOfMemory):
                raise
            trainer.pending_advice = advice  # said at the group's end, where every rank learns of it
    if need_update and trainer.runtime.distributed and not trainer.syncs_in_backward:
        agree_and_reduce(trainer)  # (DDP averaged them in the group's last backward)
    return result


def accumulate_with_oom_backoff(trainer: Trainer, group: list[dict], group_size: int, ends_group: bool = False):
    """Forward and backward of the newest batch of ``group``; after an out-of-memory error, the micro-batch is
    halved (each loader batch split in two more pieces, so the effective batch stays the same) and the whole
    group is replayed, since its gradients so far were dropped with the failed step."""
    replay = False
    while True:
        failed = False
        try:
            batches = group if replay else group[-1:]
            for i, batch in enumerate(batches):
                position = len(group) - len(batches) + i  # the batch's place in its group
                result = forward_backward(trainer, batch, group_size, ends_group and i == len(batches) - 1, position)
            return result
        except OutOfMemoryError:
            failed = True
        if failed:  # outside the except block: its traceback no longer holds the step's tensors
            save_memory_snapshot(trainer)  # trainer.memory_snapshot: on_oom; before the back-off empties the cache
            if trainer.syncs_in_backward:
                raise SyncedOutOfMemory(
                    f"rank {trainer.runtime.rank}: out of memory with train.ddp_sync: during_backward: the other "
                    f"{trainer.runtime.world_size - 1} process(es) wait in an all-reduce of the backward this process "
                    f"abandoned, so no back-off can be agreed; every process stops (torchrun stops the others, or "
                    f"trainer.process_group_timeout_s does) and last.pt stays as the last checkpoint wrote it; resume "
                    f"with --resume auto and train.ddp_sync: agreed (which backs off), or a smaller data.batch_size"
                )
            if trainer.synced_norm:
                raise SyncedOutOfMemory(
                    f"out of memory with model.norm: sync: every BatchNorm forward is synchronized across the "
                    f"{trainer.runtime.world_size} processes, so one of them cannot retry with a smaller micro-batch "
                    f"alone (the out-of-memory back-off is off with sync, and this process stops the others); "
                    f"resume from the last checkpoint with a smaller data.batch_size (or batch_size: auto), "
                    f"model.grad_checkpointing: true or a shorter train.chunk_train_size, or use model.norm: batch"
                )
            back_off_after_oom(trainer, len(group[-1]["label"]), clip_length(group[-1]))
            replay = True


def forward_backward(
    trainer: Trainer, batch: dict, group_size: int, ends_group: bool = False, position: int = 0
) -> BatchLoss:
    """One loader batch in ``state.micro_splits`` pieces; returns its summed clip losses. Under torchrun
    (train.ddp_sync: agreed) no backward communicates: ``agree_and_reduce`` averages the gradients once the group
    is done on every rank; with during_backward, DDP all-reduces during the backward of the group's last piece
    (``ends_group``: this batch is the group's last), the others under no_sync."""
    model, runtime = trainer.model, trainer.runtime
    size = len(batch["label"])
    pieces = micro_batches(trainer, batch)
    loss_sum = auxiliary_sum = 0.0
    for i, piece in enumerate(pieces):
        spec = trainer.chunk_spec(position, i)
        inputs = trainer.prepare.transfer(piece)  # frames stay uint8 until their chunk runs
        clips = len(piece["label"])
        syncs = ends_group and i == len(pieces) - 1
        with model.no_sync() if trainer.syncs_in_backward and not syncs else contextlib.nullcontext():
            with runtime.autocast():
                loss, auxiliary = step_losses(
                    model, inputs, piece, spec, trainer.cfg.train, trainer.criterion, trainer.bank
                )
                loss = with_auxiliary(loss, auxiliary)
            # a piece's mean loss weighted by its share of the batch, over the group: the group's mean loss
            trainer.scaler.scale(loss * (clips / size) / group_size).backward()
        loss_sum += float(loss.detach()) * clips
        auxiliary_sum += 0.0 if auxiliary is None else float(auxiliary.detach()) * clips
    return BatchLoss(loss_sum, auxiliary_sum, size)


def micro_batches(trainer: Trainer, batch: dict) -> list[dict]:
    """A loader batch's model keys in ``state.micro_splits`` non-empty pieces (the OOM back-off's split)."""
    keys = [k for k in MODEL_KEYS if k in batch]
    return [
        dict(zip(keys, parts))
        for parts in zip(*(torch.tensor_split(batch[k], trainer.state.micro_splits) for k in keys))
        if len(parts[0])
    ]


def training_loss(
    outputs: HeadOutput, piece: dict, spec: ChunkSpec, train_cfg: TrainConfig, criterion: torch.nn.Module
) -> torch.Tensor:
    """The loss of the label (``label_loss``), plus the forward's auxiliary loss where it has one (the chunk
    reconstruction of model.chunk_reconstruction, already weighted)."""
    loss = label_loss(outputs, piece, spec, train_cfg, criterion)
    return with_auxiliary(loss, outputs.auxiliary)


def with_auxiliary(loss: torch.Tensor, auxiliary: torch.Tensor | None) -> torch.Tensor:
    """The label's loss plus the auxiliary loss where there is one: what the optimizer minimizes."""
    return loss if auxiliary is None else loss + auxiliary.to(loss.dtype)


def label_loss(
    outputs: HeadOutput, piece: dict, spec: ChunkSpec, train_cfg: TrainConfig, criterion: torch.nn.Module
) -> torch.Tensor:
    """train.chunk_loss clip: the aggregated chunk logits (or a temporal head's clip logits) against the clip
    label (the plain loss for one chunk); dense: each chunk (a head's per-chunk logits) against the label
    covering most of its frames, chunks no segment covers left out, averaged over the chunks that count.
    ``outputs``: ChunkedTrainingForward's (or FeatureHeadForward's)."""
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
        windows = chunk_windows(clip_length(piece), spec.size, spec.overlap)
        labels = chunk_labels(piece["frame_labels"], windows).to(device)  # [n, B]
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


SMOOTHING_WEIGHT = 0.15  # MS-TCN's weight of its smoothing loss beside the cross-entropy of each stage


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


# the keys of a batch (datasets/sample.py) a micro-batch split carries: the model's inputs and what the loss reads
MODEL_KEYS = ("label", "video", "kpt", "frame_labels", "features", "windows", "mask", "chunk_labels", "sample")


def step_loss(
    model,
    inputs: Sample,
    piece: Sample,
    spec: ChunkSpec,
    train_cfg: TrainConfig,
    criterion: torch.nn.Module,
    bank: FeatureBank | None = None,
) -> torch.Tensor:
    """The forward and loss of one micro-batch, as the training step and the memory planner both run it:
    ``model`` is a ChunkedTrainingForward, ``inputs`` the uint8 model inputs on the device,
    ``piece`` the micro-batch's labels (and its clips' indices in the training set, which the bank reads by)."""
    return with_auxiliary(*step_losses(model, inputs, piece, spec, train_cfg, criterion, bank))


def step_losses(
    model,
    inputs: Sample,
    piece: Sample,
    spec: ChunkSpec,
    train_cfg: TrainConfig,
    criterion: torch.nn.Module,
    bank: FeatureBank | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``step_loss``'s two parts: the label's loss, and the forward's auxiliary loss (None without one)."""
    outputs = model(inputs, spec) if bank is None else model(inputs, spec, bank, piece["sample"])
    return label_loss(outputs, piece, spec, train_cfg, criterion), outputs.auxiliary


def clips_per_forward(trainer: Trainer) -> int:
    return math.ceil(trainer.cfg.data.batch_size / trainer.state.micro_splits)


def optimizer_step(trainer: Trainer) -> None:
    optimizer, scaler, state = trainer.optimizer, trainer.scaler, trainer.state
    grad_clip = max_grad_norm(trainer.cfg.train, trainer.has_temporal_head)
    norm = None  # of all gradients together: inf or NaN if any of them is
    if grad_clip is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), grad_clip)
    if scaler.is_enabled():
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        stepped = scaler.get_scale() >= scale_before  # a lowered scale means inf/NaN gradients: step skipped
    else:
        if norm is None:  # one fused norm and one device sync, not one per parameter
            norm = torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters() if p.grad is not None])
        stepped = bool(torch.isfinite(norm)) and state.nonfinite_streak == 0
        if stepped:
            optimizer.step()
    if not stepped:
        state.skipped_steps += 1
        log.warning(
            "step %d skipped: non-finite loss or gradients (%d skipped so far)", state.global_step, state.skipped_steps
        )
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # a step skipped for inf/NaN gradients still advances the schedule (it counts optimizer steps); torch
        # warns about a scheduler step before any optimizer step, which is then expected
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        trainer.scheduler.step()
    state.global_step += 1
