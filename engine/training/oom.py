"""The out-of-memory back-off: a step that runs out of memory is retried with half the training chunks kept
unrecomputed (train.recompute: auto), then half the micro-batch, then half the training chunk; only when one chunk
of the model's shortest length does not fit does the run stop, with advice.
Under DDP every rank agrees on the back-off at the end of each accumulation group (``agree_and_reduce``)."""

from __future__ import annotations

import logging
import math
import pickle

import torch

from core import memory_monitor
from core.files import DiskFullError, atomic_open
from core.runtime import unwrap_model
from engine.training.trainer import RunStopped, Trainer

log = logging.getLogger("longvideo")

OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class OutOfMemoryAdvice(RunStopped):
    pass


class SyncedOutOfMemory(OutOfMemoryAdvice):
    """An OOM under SyncBatchNorm: the other ranks wait inside a collective of the forward that this rank
    abandoned, so no agreement can be reached; this rank stops (torchrun then stops the others), saving nothing:
    its step is half done and the advice says to resume from the last checkpoint."""

    saves_checkpoint = False


MEMORY_VIEWER = "https://pytorch.org/memory_viz"


def start_memory_history(trainer: Trainer) -> None:
    """trainer.memory_snapshot: on_oom: CUDA's allocator records its history from here on; on another device
    there is no allocator to record, said once."""
    if trainer.cfg.trainer.memory_snapshot != "on_oom":
        return
    if trainer.runtime.device.type != "cuda":
        log.info(
            "trainer.memory_snapshot: on_oom records CUDA's allocator; on %s nothing is recorded",
            trainer.runtime.device,
        )
        return
    memory_monitor.record_allocator_history()
    trainer.report.memory_history = True


def save_memory_snapshot(trainer: Trainer) -> str | None:
    """At an out-of-memory error, with the allocator's history recorded: the snapshot as the run's
    memory_snapshot.pickle (atomically; the latest error's), named in the log with its viewer. A snapshot that
    cannot be written is said, not raised: the back-off goes on without it."""
    if not trainer.report.memory_history:
        return None
    if trainer.run is None:  # only rank 0 has the run directory
        log.warning(
            "rank %d: out of memory; its allocator snapshot is not written (only rank 0 writes the run's files)",
            trainer.runtime.rank,
        )
        return None
    path = trainer.run.memory_snapshot
    try:
        with atomic_open(path) as f:
            pickle.dump(memory_monitor.allocator_snapshot(), f)
    except (OSError, DiskFullError) as e:  # a full disk names the file already
        reason = str(e) if isinstance(e, DiskFullError) else f"{path}: {e}"
        log.warning("%s; the allocator snapshot of this out-of-memory error is not kept, the run goes on", reason)
        return None
    log.warning(
        "out of memory at step %d: the allocator's snapshot is %s (open it at %s)",
        trainer.state.global_step,
        path,
        MEMORY_VIEWER,
    )
    return path


def back_off_after_oom(trainer: Trainer, batch_size: int, length: int) -> None:
    """Halve the training chunks kept unrecomputed; with none kept, halve the micro-batch; at 1 clip per forward,
    halve the training chunk instead (down to the model's shortest clip); only when one chunk of that length does
    not fit, save and stop with the advice."""
    trainer.optimizer.zero_grad(set_to_none=True)
    if trainer.runtime.device.type == "cuda":
        torch.cuda.empty_cache()
    state, cfg = trainer.state, trainer.cfg
    kept = trainer.chunk_spec().kept
    if kept:
        state.kept_chunks = kept // 2
        log.warning(
            "out of memory with the activations of %d training chunks kept: now %d kept, the others "
            "recomputed in backward (train.recompute: auto; kept for the rest of the run and saved in the "
            "checkpoint); the step is retried",
            kept,
            state.kept_chunks,
        )
        return
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
            f"4) a smaller model or preset (configs/gtx1650.yaml)",
        )
    state.micro_splits *= 2
    log.warning(
        "out of memory at %d clips per forward: now %d per forward, %d forwards per batch of %d and %d "
        "batches per step (the effective batch is unchanged); the step is retried",
        per_forward,
        math.ceil(batch_size / state.micro_splits),
        state.micro_splits,
        batch_size,
        cfg.train.accumulate_grad_batches,
    )


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
    log.warning(
        "out of memory at 1 clip per forward in chunks of %s: now chunks of %s (overlap %d), each "
        "recomputed in backward; kept for the rest of the run and saved in the checkpoint; the step is "
        "retried",
        _frames(current),
        _frames(shorter),
        trainer.chunk_spec().overlap,
    )
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
    gradients. Gradients are not all-reduced during backward (no DDP hook in backward): a rank that runs out of
    memory inside a syncing backward would leave the others waiting in a collective it abandoned, and a rank
    that splits its micro-batch runs more forwards than the others. The price: communication no longer overlaps
    the backward. The agreement takes the most cautious of each: the most splits, the shortest chunks, the fewest
    chunks kept unrecomputed."""
    state, runtime = trainer.state, trainer.runtime
    no_chunk = 2**30  # "no training chunk" in the minimum
    chunk = no_chunk if state.chunk_train_size is None else state.chunk_train_size
    kept = state.kept_chunks or 0
    mine = (state.micro_splits, chunk, kept, trainer.pending_advice is not None)
    flags = torch.tensor(
        [state.micro_splits, -chunk, -kept, float(mine[3])], dtype=torch.float64, device=runtime.device
    )
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    splits, agreed_chunk, agreed_kept, gave_up = int(flags[0]), int(-flags[1]), int(-flags[2]), bool(flags[3])
    if (splits, agreed_chunk, agreed_kept) != mine[:3]:
        log.warning(
            "rank %d: another rank ran out of memory: now %d forwards per batch and %s%s, as every rank "
            "(kept for the rest of the run)",
            runtime.rank,
            splits,
            "whole clips" if agreed_chunk == no_chunk else f"training chunks of {agreed_chunk} frames",
            f" ({agreed_kept} of them kept unrecomputed)" if kept else "",
        )
    state.micro_splits, state.chunk_train_size = splits, None if agreed_chunk == no_chunk else agreed_chunk
    state.kept_chunks = agreed_kept if state.kept_chunks is not None else None
    if gave_up:
        advice = trainer.pending_advice  # every rank stops here; rank 0 saves (saved_on_stop), whichever gave up
        raise (
            advice
            if advice is not None
            else OutOfMemoryAdvice(
                "another rank ran out of memory with 1 clip per forward pass in chunks of the model's shortest length",
                "See that rank's advice",
            )
        )
    average_gradients([p.grad for p in trainer.model.parameters() if p.grad is not None], runtime.world_size)


GRADIENT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size: the most extra memory the averaging holds


def average_gradients(grads: list, world_size: int, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Every rank's gradients summed and divided by ``world_size``, in place, bucket by bucket: the extra memory is
    one bucket of at most ``bucket_bytes`` (a contiguous gradient as large as a bucket is reduced where it is), not
    a copy of every gradient (133 MB for r3d_18, 254 MB for resnet34 in fp32)."""
    bucket: list = []

    def reduce() -> None:
        if len(bucket) == 1 and bucket[0].is_contiguous():
            torch.distributed.all_reduce(bucket[0])
            bucket[0] /= world_size
        else:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            torch.distributed.all_reduce(flat)
            flat /= world_size
            for grad, part in zip(bucket, torch.split(flat, [g.numel() for g in bucket])):
                grad.copy_(part.view_as(grad))
        bucket.clear()

    filled = 0
    for grad in grads:
        size = grad.numel() * grad.element_size()
        if bucket and (filled + size > bucket_bytes or grad.dtype != bucket[0].dtype):
            reduce()
            filled = 0
        bucket.append(grad)
        filled += size
    if bucket:
        reduce()
