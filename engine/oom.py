"""The out-of-memory back-off: a step that runs out of memory is retried with half the micro-batch, then half the
training chunk; only when one chunk of the model's shortest length does not fit does the run stop, with advice.
Under DDP every rank agrees on the back-off at the end of each accumulation group (``agree_and_reduce``)."""
from __future__ import annotations

import logging
import math

import torch

from core.runtime import unwrap_model
from engine.trainer import RunStopped, Trainer

log = logging.getLogger("longvideo")

OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class OutOfMemoryAdvice(RunStopped):
    pass


class SyncedOutOfMemory(OutOfMemoryAdvice):
    """An OOM under SyncBatchNorm: the other ranks wait inside a collective of the forward that this rank
    abandoned, so no agreement can be reached; this rank stops (torchrun then stops the others), saving nothing:
    its step is half done and the advice says to resume from the last checkpoint."""
    saves_checkpoint = False


def back_off_after_oom(trainer: Trainer, batch_size: int, length: int) -> None:
    """Halve the micro-batch; at 1 clip per forward, halve the training chunk instead (down to the model's
    shortest clip); only when one chunk of that length does not fit, save and stop with the advice."""
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.runtime.device.type == "cuda":
        torch.cuda.empty_cache()
    state, cfg = trainer.state, trainer.cfg
    per_forward = math.ceil(batch_size / state.micro_splits)
    if per_forward <= 1:
        if _shorten_chunks(trainer, length):
            return
        data, model = cfg.data, cfg.model
        raise OutOfMemoryAdvice(
            f"out of memory with 1 clip per forward pass in chunks of {_frames(_chunk_frames(trainer, length))} "
            f"(the model's shortest)",
            f"To fit, in this order: "
            f"1) smaller frames (data.img_size={data.img_size}), "
            f"2) model.grad_checkpointing: true (now {str(model.grad_checkpointing).lower()}), "
            f"3) trainer.precision 16/bf16 (now {trainer.runtime.precision}), "
            f"4) a smaller model or preset (configs/gtx1650.yaml)")
    state.micro_splits *= 2
    log.warning("out of memory at %d clips per forward: now %d per forward, %d forwards per batch of %d and %d "
                "batches per step (the effective batch is unchanged); the step is retried", per_forward,
                math.ceil(batch_size / state.micro_splits), state.micro_splits, batch_size,
                cfg.train.accumulate_grad_batches)


def _shorten_chunks(trainer: Trainer, length: int) -> bool:
    """At 1 clip per forward: chunks of half the length (from whole clips: the largest power of two below the
    clip length), not below the model's ``min_frames``. False when they cannot get shorter."""
    min_frames = getattr(unwrap_model(trainer.model), "min_frames", 1)
    current = _chunk_frames(trainer, length)
    shorter = 2 ** math.floor(math.log2(current - 1)) if current == length and current > 1 else current // 2
    shorter = max(shorter, min_frames)
    if shorter >= current:
        return False
    trainer.state.chunk_train_size = shorter
    log.warning("out of memory at 1 clip per forward in chunks of %s: now chunks of %s (overlap %d), each "
                "recomputed in backward; kept for the rest of the run and saved in the checkpoint; the step is "
                "retried", _frames(current), _frames(shorter), trainer.chunk_spec().overlap)
    return True


def _chunk_frames(trainer: Trainer, length: int) -> int:
    """Frames per training chunk now, for a clip of ``length`` frames."""
    size = trainer.chunk_spec().size
    return length if size == -1 else min(size, length)


def _frames(count: int) -> str:
    return f"{count} frame" + ("" if count == 1 else "s")


def agree_and_reduce(trainer: Trainer) -> None:
    """DDP, at the end of an accumulation group: one all-reduce of each rank's back-off (micro-batch splits,
    training chunk, whether it gave up) in which every rank takes the most cautious, then one all-reduce of the
    gradients. Gradients are not all-reduced during backward (DDP's no_sync throughout): a rank that runs out of
    memory inside a syncing backward would leave the others waiting in a collective it abandoned, and a rank
    that splits its micro-batch runs more forwards than the others. The price: communication no longer overlaps
    the backward."""
    state, runtime = trainer.state, trainer.runtime
    no_chunk = 2 ** 30  # "no training chunk" in the minimum
    chunk = no_chunk if state.chunk_train_size is None else state.chunk_train_size
    mine = (state.micro_splits, chunk, trainer.pending_advice is not None)
    flags = torch.tensor([state.micro_splits, -chunk, float(mine[2])], dtype=torch.float64, device=runtime.device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    splits, agreed_chunk, gave_up = int(flags[0]), int(-flags[1]), bool(flags[2])
    if (splits, agreed_chunk) != mine[:2]:
        log.warning("rank %d: another rank ran out of memory: now %d forwards per batch and %s, as every rank "
                    "(kept for the rest of the run)", runtime.rank, splits,
                    "whole clips" if agreed_chunk == no_chunk else f"training chunks of {agreed_chunk} frames")
    state.micro_splits, state.chunk_train_size = splits, None if agreed_chunk == no_chunk else agreed_chunk
    if gave_up:
        advice = trainer.pending_advice  # every rank stops here; rank 0 saves (saved_on_stop), whichever gave up
        raise advice if advice is not None else OutOfMemoryAdvice(
            "another rank ran out of memory with 1 clip per forward pass in chunks of the model's shortest length",
            "See that rank's advice")
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= runtime.world_size
        for grad, part in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            grad.copy_(part.view_as(grad))
