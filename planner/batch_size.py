"""The decisions taken from the estimates: ``data.batch_size: auto`` / ``--fit-budget`` (the largest micro-batch
that fits, with the accumulation that keeps the global batch), the training chunks whose activations the budget
holds, and ``infer_chunked.py --batch auto``."""

from __future__ import annotations

import logging

from config import Config, apply_flags
from core.errors import ConfigError, UsageError
from core.runtime import Runtime
from datasets.shape import DataShape
from planner.estimate import margin_text, usable_bytes
from planner.memory_table import nothing_fits
from planner.project import (
    LoopStep,
    clip_frames,
    config_training_estimate,
    graph_chunk_count,
    largest_batch,
    largest_inference_batch,
    most_chunks_kept,
)

log = logging.getLogger("longvideo")


def batch_for_budget(cfg: Config, runtime: Runtime, data_shape: DataShape, step: LoopStep) -> Config:
    """data.batch_size: auto (or --fit-budget): the largest micro-batch whose estimate fits the budget, and the
    accumulation that keeps the global batch (train.global_batch_size, or batch x accumulation as written).
    Returns a new config holding the decision (the run's config.yaml and checkpoints record it)."""
    shape = {**data_shape.model_args(), "world_size": runtime.world_size}  # of each training estimate
    data, train_cfg, budget = cfg.data, cfg.train, cfg.trainer.memory_budget_gb
    cuda = runtime.device.type == "cuda"
    usable = usable_bytes(budget, cuda)
    frames = clip_frames(cfg.data)
    fitting, tried = largest_batch(cfg, step, frames, usable, **shape)
    if not fitting:
        raise ConfigError(nothing_fits(cfg, step, frames, tried[0][1].peak, usable, budget, cuda, shape))
    global_batch = train_cfg.global_batch_size
    if global_batch is None and data.batch_size != "auto":
        global_batch = data.batch_size * train_cfg.accumulate_grad_batches * runtime.world_size
    if global_batch is None:  # batch_size: auto without a global batch: the accumulation stays as written
        batch, accumulate = fitting, train_cfg.accumulate_grad_batches
    else:
        if global_batch % runtime.world_size:
            raise ConfigError(
                f"train.global_batch_size={global_batch} must be a multiple of the {runtime.world_size} processes"
            )
        per_process = global_batch // runtime.world_size
        batch = max(b for b in range(1, min(fitting, per_process) + 1) if per_process % b == 0)
        accumulate = per_process // batch
    estimate = next((e for b, e in tried if b == batch), None) or config_training_estimate(
        cfg, step, frames, batch, **shape
    )
    log.info(
        "memory budget: batch %d x %d accumulated x %d processes (largest batch that fits: %d), estimated "
        "peak %.2f GiB of %s",
        batch,
        accumulate,
        runtime.world_size,
        fitting,
        estimate.peak / 2**30,
        margin_text(budget, cuda),
    )
    fitted = "the memory planner (data.batch_size: auto / --fit-budget)"
    return apply_flags(cfg, {"data.batch_size": (fitted, batch), "train.accumulate_grad_batches": (fitted, accumulate)})


def chunks_to_keep(cfg: Config, runtime: Runtime, data_shape: DataShape, step: LoopStep) -> int:
    """How many training chunks keep their activations (the last of each clip; the rest are recomputed in
    backward): the most whose estimated step fits trainer.memory_budget_gb at the run's batch, so recomputation is
    paid only where the budget forces it. 0 (every chunk recomputed) without training chunks or without a budget
    (said in the log)."""
    if cfg.train.chunk_train_size == -1:
        return 0
    frames = clip_frames(cfg.data)
    chunks = graph_chunk_count(cfg, frames)
    if chunks <= 1:
        return 0
    budget = cfg.trainer.memory_budget_gb
    if not budget:
        log.info(
            "training chunks without trainer.memory_budget_gb: every training chunk is recomputed in backward; with "
            "a budget, the chunks it holds keep their activations"
        )
        return 0
    cuda = runtime.device.type == "cuda"
    kept, peaks = most_chunks_kept(
        cfg,
        step,
        frames,
        cfg.data.batch_size,
        usable_bytes(budget, cuda),
        world_size=runtime.world_size,
        **data_shape.model_args(),
    )
    peak = peaks[kept]
    log.info(
        "the memory budget: keeping the activations of %d of %d training chunks, recomputing %d in "
        "backward (estimated peak %.2f GiB of %s)",
        kept,
        chunks,
        chunks - kept,
        peak / 2**30,
        margin_text(budget, cuda),
    )
    return kept


def inference_batch_for_budget(
    cfg: Config, runtime: Runtime, data_shape: DataShape, budget_gb: float | None = None, clips_per_window: int = 1
) -> int:
    """--batch auto: the most inference chunks (``cfg.infer.chunk_size``) per forward whose estimated peak fits the
    budget (``budget_gb``, else the config's trainer.memory_budget_gb), for each of ``clips_per_window`` (eval.py's
    test clips x crops of a window, which go through each forward together)."""
    chunk = cfg.infer.chunk_size
    budget = budget_gb or cfg.trainer.memory_budget_gb
    if not budget:
        raise UsageError(
            "--batch auto needs a memory budget: --memory-budget-gb N (the checkpoint's config has no "
            "trainer.memory_budget_gb)"
        )
    cuda = runtime.device.type == "cuda"
    usable = usable_bytes(budget, cuda)
    frames = chunk if chunk != -1 else clip_frames(cfg.data)
    shape = data_shape.model_args()
    batch = largest_inference_batch(cfg, frames, usable, precision=runtime.precision, **shape)
    if not batch:
        raise UsageError(
            f"--batch auto: even 1 chunk of {frames} frames does not fit the "
            f"{margin_text(budget, cuda)}; use a shorter --chunk"
        )
    print(f"--batch auto: {batch} chunks of {frames} frames per forward ({margin_text(budget, cuda)})")
    return max(1, batch // clips_per_window)
