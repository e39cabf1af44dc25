"""The out-of-memory back-off (``with_oom_backoff``, around the loop's forward and backward): a step that runs out of
memory is retried with half the training chunks kept unrecomputed, then half the micro-batch, then half the
training chunk; only when one chunk of the model's shortest length does not fit does the run stop, with advice.
Under DDP every rank agrees on the back-off at the end of each accumulation group (``agree_and_reduce``)."""

from __future__ import annotations

import logging
import math
import pickle
from typing import Callable

import torch

from core import memory_monitor
from core.files import DiskFullError, atomic_open
from core.runtime import unwrap_model
from engine.inference.chunks import clip_length
from engine.training.run import RunStopped, TrainingRun
from engine.training.step import BatchLoss

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


def with_oom_backoff(
    run: TrainingRun, group: list[dict], group_size: int, ends_group: bool, train_batch: Callable[..., BatchLoss]
) -> BatchLoss:
    """``train_batch(run, batch, group_size, position, ends_group)`` (train.py's forward and backward of one loader
    batch) on the newest batch of the accumulation group ``group``. After an out-of-memory error the back-off is
    taken (``back_off_after_oom``) and the whole group is replayed, since its gradients so far were dropped with the
    failed step. Under DDP a rank that can back off no further sits out the rest of its group, and every rank
    learns of it at the group's end (``agree_and_reduce``)."""
    if run.pending_advice is not None:
        return BatchLoss()
    try:
        return _replayed_on_oom(run, group, group_size, ends_group, train_batch)
    except OutOfMemoryAdvice as advice:
        if not run.runtime.distributed or isinstance(advice, SyncedOutOfMemory):
            raise
        run.pending_advice = advice  # said at the group's end, where every rank learns of it
        return BatchLoss()


def _replayed_on_oom(run: TrainingRun, group: list[dict], group_size: int, ends_group: bool, train_batch) -> BatchLoss:
    replay = False
    while True:
        failed = False
        try:
            batches = group if replay else group[-1:]
            for i, batch in enumerate(batches):
                position = len(group) - len(batches) + i  # the batch's place in its group
                result = train_batch(run, batch, group_size, position, ends_group and i == len(batches) - 1)
            return result
        except OutOfMemoryError:
            failed = True
        if failed:  # outside the except block: its traceback no longer holds the step's tensors
            save_memory_snapshot(run)  # trainer.memory_snapshot: on_oom; before the back-off empties the cache
            _refuse_backoff_with_collectives(run)
            back_off_after_oom(run, len(group[-1]["label"]), clip_length(group[-1]))
            replay = True


def _refuse_backoff_with_collectives(run: TrainingRun) -> None:
    """A process whose forward or backward holds a collective cannot retry alone: it stops with the advice."""
    if run.syncs_in_backward:
        raise SyncedOutOfMemory(
            f"rank {run.runtime.rank}: out of memory with train.ddp_sync: during_backward: the other "
            f"{run.runtime.world_size - 1} process(es) wait in an all-reduce of the backward this process "
            f"abandoned, so no back-off can be agreed; every process stops (torchrun stops the others, or "
            f"trainer.process_group_timeout_s does) and last.pt stays as the last checkpoint wrote it; resume "
            f"with --resume auto and train.ddp_sync: agreed (which backs off), or a smaller data.batch_size"
        )
    if run.synced_norm:
        raise SyncedOutOfMemory(
            f"out of memory with model.norm: sync: every BatchNorm forward is synchronized across the "
            f"{run.runtime.world_size} processes, so one of them cannot retry with a smaller micro-batch "
            f"alone (the out-of-memory back-off is off with sync, and this process stops the others); "
            f"resume from the last checkpoint with a smaller data.batch_size (or batch_size: auto), "
            f"model.recompute_blocks: true or a shorter train.chunk_train_size, or use model.norm: batch"
        )


def start_memory_history(run: TrainingRun) -> None:
    """trainer.memory_snapshot: on_oom: CUDA's allocator records its history from here on; on another device
    there is no allocator to record, said once."""
    if run.cfg.trainer.memory_snapshot != "on_oom":
        return
    if run.runtime.device.type != "cuda":
        log.info(
            "trainer.memory_snapshot: on_oom records CUDA's allocator; on %s nothing is recorded",
            run.runtime.device,
        )
        return
    memory_monitor.record_allocator_history()
    run.report.memory_history = True


def save_memory_snapshot(run: TrainingRun) -> str | None:
    """At an out-of-memory error, with the allocator's history recorded: the snapshot as the run's
    memory_snapshot.pickle (atomically; the latest error's), named in the log with its viewer. A snapshot that
    cannot be written is said, not raised: the back-off goes on without it."""
    if not run.report.memory_history:
        return None
    if run.directory is None:  # only rank 0 has the run directory
        log.warning(
            "rank %d: out of memory; its allocator snapshot is not written (only rank 0 writes the run's files)",
            run.runtime.rank,
        )
        return None
    path = run.directory.memory_snapshot
    try:
        with atomic_open(path) as f:
            pickle.dump(memory_monitor.allocator_snapshot(), f)
    except (OSError, DiskFullError) as e:  # a full disk names the file already
        reason = str(e) if isinstance(e, DiskFullError) else f"{path}: {e}"
        log.warning("%s; the allocator snapshot of this out-of-memory error is not kept, the run goes on", reason)
        return None
    log.warning(
        "out of memory at step %d: the allocator's snapshot is %s (open it at %s)",
        run.state.global_step,
        path,
        MEMORY_VIEWER,
    )
    return path


def back_off_after_oom(run: TrainingRun, batch_size: int, length: int) -> None:
    """Halve the training chunks kept unrecomputed; with none kept, halve the micro-batch; at 1 clip per forward,
    halve the training chunk instead (down to the model's shortest clip); only when one chunk of that length does
    not fit, save and stop with the advice."""
    run.optimizer.zero_grad(set_to_none=True)
    if run.runtime.device.type == "cuda":
        torch.cuda.empty_cache()
    state, cfg = run.state, run.cfg
    kept = run.chunk_spec().kept
    if kept:
        state.kept_chunks = kept // 2
        log.warning(
            "out of memory with the activations of %d training chunks kept: now %d kept, the others "
            "recomputed in backward (kept for the rest of the run and saved in the checkpoint); the step is retried",
            kept,
            state.kept_chunks,
        )
        return
    per_forward = math.ceil(batch_size / state.micro_splits)
    if per_forward <= 1:
        if _shorten_chunks(run, length):
            return
        data, model = cfg.data, cfg.model
        raise OutOfMemoryAdvice(
            f"out of memory with 1 clip per forward pass in chunks of {_frames(_chunk_frames(run, length))} "
            f"(the model's shortest)",
            f"To fit, in this order: "
            f"1) smaller frames (data.img_size={data.img_size}), "
            f"2) model.recompute_blocks: true (now {str(model.recompute_blocks).lower()}), "
            f"3) trainer.precision 16/bf16 (now {run.runtime.precision}), "
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


def _shorten_chunks(run: TrainingRun, length: int) -> bool:
    """At 1 clip per forward: chunks of half the length (from whole clips: the largest power of two below the
    clip length), not below the model's ``min_frames``. False when they cannot get shorter."""
    min_frames = getattr(unwrap_model(run.model), "min_frames", 1)
    current = _chunk_frames(run, length)
    shorter = 2 ** math.floor(math.log2(current - 1)) if current == length and current > 1 else current // 2
    shorter = max(shorter, min_frames)
    if shorter >= current:
        return False
    run.state.chunk_train_size = shorter
    log.warning(
        "out of memory at 1 clip per forward in chunks of %s: now chunks of %s (overlap %d), each "
        "recomputed in backward; kept for the rest of the run and saved in the checkpoint; the step is "
        "retried",
        _frames(current),
        _frames(shorter),
        run.chunk_spec().overlap,
    )
    return True


def _chunk_frames(run: TrainingRun, length: int) -> int:
    """Frames per training chunk now, for a clip of ``length`` frames."""
    size = run.chunk_spec().size
    return length if size == -1 else min(size, length)


def _frames(count: int) -> str:
    return f"{count} frame" + ("" if count == 1 else "s")


def agree_and_reduce(run: TrainingRun) -> None:
    """DDP, at the end of an accumulation group: one all-reduce of each rank's back-off (micro-batch splits,
    training chunk, whether it gave up) in which every rank takes the most cautious, then one all-reduce of the
    gradients. Gradients are not all-reduced during backward (no DDP hook in backward): a rank that runs out of
    memory inside a syncing backward would leave the others waiting in a collective it abandoned, and a rank
    that splits its micro-batch runs more forwards than the others. The price: communication no longer overlaps
    the backward. The agreement takes the most cautious of each: the most splits, the shortest chunks, the fewest
    chunks kept unrecomputed."""
    state, runtime = run.state, run.runtime
    no_chunk = 2**30  # "no training chunk" in the minimum
    chunk = no_chunk if state.chunk_train_size is None else state.chunk_train_size
    kept = state.kept_chunks or 0
    mine = (state.micro_splits, chunk, kept, run.pending_advice is not None)
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
        advice = run.pending_advice  # every rank stops here; rank 0 saves (saved_on_stop), whichever gave up
        raise (
            advice
            if advice is not None
            else OutOfMemoryAdvice(
                "another rank ran out of memory with 1 clip per forward pass in chunks of the model's shortest length",
                "See that rank's advice",
            )
        )
    average_gradients([p.grad for p in run.model.parameters() if p.grad is not None], runtime.world_size)


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
