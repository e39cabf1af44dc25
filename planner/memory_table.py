"""``train.py --probe-memory``: the table of estimated (and with CUDA measured) peak memory over a grid of clip
lengths and batch sizes, and the advice when not even one clip fits."""

from __future__ import annotations

import math
import time

import torch

from config import Config, ModelConfig, derive
from core.errors import UsageError
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.records import read_split
from datasets.shape import DataShape
from engine.training.oom import GRADIENT_BUCKET_BYTES
from planner.disk import disk_plan, model_on_meta, state_disk_plan
from planner.estimate import GiB, MiB, margin_text, usable_bytes
from planner.host import loader_host_bytes
from planner.project import (
    LoopStep,
    ProjectStep,
    clip_frames,
    config_training_estimate,
    graph_chunk_count,
    largest_batch,
    measure_training_step_cuda,
    most_chunks_kept,
)

WHY = "--probe-memory's alternative"  # names the change in the error of a config the checks refuse


def probe_memory(
    cfg: Config,
    step: LoopStep,
    device: str | None,
    frames_arg: str | None,
    batches_arg: str | None,
    world_size: int = 1,
) -> int:
    """--probe-memory: estimated (and with CUDA measured) peak memory per num_frames x batch_size, and the
    largest batch that fits the budget; for ``world_size`` processes (torchrun)."""

    def grid(text):
        try:
            return sorted({int(v) for v in text.split(",")}) if text else None
        except ValueError:
            raise UsageError(f"--probe-frames/--probe-batches: {text!r} is not a comma-separated list of integers")

    if world_size < 1:
        raise UsageError(f"--world-size {world_size}: the number of processes must be 1 or more")
    for_gpu = (device or cfg.trainer.device) != "cpu"  # the budget of a GPU (its context set aside)
    if cfg.trainer.precision == "amp":  # what --use_amp means on a GPU, which the estimate is for
        cfg = derive(cfg, {"trainer.precision": "16"}, "--use_amp on a GPU")
    shape = DataShape.of_manifest(cfg).model_args()

    def out(line: str) -> None:
        print(line, flush=True)

    code = probe(
        cfg,
        step,
        for_gpu and torch.cuda.is_available(),
        grid(frames_arg),
        grid(batches_arg),
        out=out,
        for_gpu=for_gpu,
        world_size=world_size,
        **shape,
    )
    classifier = model_on_meta(ProjectStep(cfg, step, **shape).classifier)
    state_disk_plan(disk_plan(cfg, classifier, _steps_per_epoch(cfg)), cfg.trainer.output_dir, out)
    return code


def _steps_per_epoch(cfg: Config) -> int:
    """Optimizer steps of an epoch if each training manifest line is one sample (more with sample windows)."""
    try:
        samples = len(read_split(cfg.data, "train", labelled=cfg.train.reads_labels))
    except BAD_INPUT_ERRORS + (OSError,):
        samples = 1
    batch = cfg.data.batch_size if isinstance(cfg.data.batch_size, int) else 1
    return math.ceil(samples / (batch * cfg.train.accumulate_grad_batches))


def probe(
    cfg: Config,
    step: LoopStep,
    cuda: bool,
    frames_grid: list[int] | None = None,
    batch_grid: list[int] | None = None,
    out=print,
    for_gpu: bool = True,
    world_size: int = 1,
    **shape,
) -> int:
    """The table of ``train.py --probe-memory``: estimated peak per num_frames x batch_size, blocks kept and
    recomputed (model.recompute_blocks) (with CUDA: measured beside the estimate for the preset's setting), then the
    largest batch within the budget at the preset's clip, or at the longest of ``frames_grid`` where one is given
    (``for_gpu``: the CUDA context set aside from it).
    Rows are printed as they are computed. ``world_size`` > 1: the estimates hold the bucket the gradients are
    averaged through, and a line says what several processes add."""
    data, model_cfg = cfg.data, cfg.model
    frames = clip_frames(cfg.data)
    batch = data.batch_size if isinstance(data.batch_size, int) else 8
    asked_frames, asked_batches = frames_grid is not None, batch_grid is not None
    frames_grid = frames_grid or sorted({max(1, round(frames * f)) for f in (0.5, 0.75, 1, 1.25, 1.5)})
    batch_grid = batch_grid or sorted({max(1, round(batch * f)) for f in (2 / 3, 1, 4 / 3)})
    precision = cfg.trainer.precision
    out(
        f"peak device memory of one training step: {model_cfg.backbone} at {data.img_size[0]}x"
        f"{data.img_size[1]}, precision {precision}, norm {_norm_text(model_cfg)}, {cfg.train.optimizer}, "
        f"chunk_train_size "
        f"{cfg.train.chunk_train_size}, accumulate_grad_batches {cfg.train.accumulate_grad_batches}"
    )
    out(
        f"estimated{'' if cuda else ', no GPU'} (torch {torch.__version__.split('+')[0]}, fake tensors, CUDA's "
        f"autocast policy): peak allocated memory, without the CUDA context, cuDNN workspaces and fragmentation"
    )
    # the two columns: model.recompute_blocks false (each backbone stage's activations kept) and true
    recomputed = model_cfg.recompute_blocks
    header = f"{'num_frames':>10s} {'batch':>5s} {'stages kept MiB':>15s} {'recomputed MiB':>14s}"
    if cuda:
        header += (
            f" | measured (stages {'recomputed' if recomputed else 'kept'}): {'allocated':>9s} {'reserved':>9s} "
            f"{'est/alloc':>9s}"
        )
    out(header)
    start = time.perf_counter()
    for num_frames in frames_grid:
        for batch_size in batch_grid:
            estimates = {
                recompute: config_training_estimate(
                    derive(cfg, {"model.recompute_blocks": recompute}, WHY),
                    step,
                    num_frames,
                    batch_size,
                    world_size=world_size,
                    **shape,
                ).peak
                for recompute in (False, True)
            }
            line = f"{num_frames:>10d} {batch_size:>5d} {estimates[False] / MiB:>15.0f} {estimates[True] / MiB:>14.0f}"
            if cuda:
                measured = measure_training_step_cuda(cfg, step, num_frames, batch_size, **shape)
                if measured is None:
                    line += f" | {'':>25s} {'OOM':>9s}"
                else:
                    line += (
                        f" | {'':>25s} {measured['allocated'] / MiB:>9.0f} {measured['reserved'] / MiB:>9.0f} "
                        f"{estimates[recomputed] / measured['allocated']:>8.2f}x"
                    )
            out(line)
    out(f"({len(frames_grid) * len(batch_grid) * 2} estimates in {time.perf_counter() - start:.0f} s)")
    host = loader_host_bytes(cfg, DataShape(**shape), cuda=for_gpu)
    out(f"host memory of the training loader (estimated, planner/host.py): {host.text()}")
    if world_size > 1:
        out(_processes_text(cfg, step, frames, batch, world_size, shape))
    budget = cfg.trainer.memory_budget_gb
    if not budget:
        out("trainer.memory_budget_gb is not set: no largest batch computed")
        return 0
    usable = usable_bytes(budget, cuda=for_gpu)
    searched = max(frames_grid) if asked_frames else frames  # the clip the user probed, else the preset's
    best, _ = largest_batch(cfg, step, searched, usable, progress=out, world_size=world_size, **shape)
    out(margin_text(budget, cuda=for_gpu))
    out(
        f"largest batch at num_frames={searched} (stages {'recomputed' if recomputed else 'kept'}, as in the "
        f"preset) that fits: {best if best else 'none: even 1 clip does not fit'}"
    )
    train_cfg = cfg.train
    if train_cfg.chunk_train_size != -1:
        batch = max(batch_grid) if asked_batches else batch  # the batch probed, else the preset's
        kept, peaks = most_chunks_kept(cfg, step, searched, batch, usable, out, world_size=world_size, **shape)
        recompute_all = (
            peaks.get(0) or config_training_estimate(cfg, step, searched, batch, world_size=world_size, **shape).peak
        )
        chunks = graph_chunk_count(cfg, searched)
        sampled = "" if train_cfg.grad_chunks == "all" else " with a gradient (train.grad_chunks)"
        out(
            f"the memory budget at batch {batch}: keeps the activations of {kept} of {chunks} training chunks"
            f"{sampled} "
            f"(estimated peak {peaks[kept] / MiB:.0f} MiB; every chunk recomputed: {recompute_all / MiB:.0f} MiB; "
            f"the table's estimates recompute every chunk)"
        )
    return 0


def _processes_text(cfg: Config, step: LoopStep, frames: int, batch: int, world_size: int, shape: dict) -> str:
    """What ``world_size`` processes hold beyond one, at the preset's clip and batch."""
    alone = config_training_estimate(cfg, step, frames, batch, **shape)
    several = config_training_estimate(cfg, step, frames, batch, world_size=world_size, **shape)
    added = several.peak - alone.peak
    if cfg.train.ddp_sync == "during_backward":
        return (
            f"{world_size} processes, train.ddp_sync: during_backward: DistributedDataParallel's buckets, "
            f"{alone.gradients / MiB:.0f} MiB (the gradients' size; counted above: +{added / MiB:.0f} MiB at the "
            f"peak); NCCL's own buffers lie outside PyTorch's allocator and are not counted"
        )
    bucket = min(GRADIENT_BUCKET_BYTES, alone.gradients)
    return (
        f"{world_size} processes: gradients averaged in place after backward through one bucket of "
        f"{bucket / MiB:.0f} MiB (counted above; "
        f"{'below the peak, which it leaves unchanged' if added <= 0 else f'+{added / MiB:.0f} MiB at the peak'}"
        f"); no DistributedDataParallel buckets, no second copy of the {alone.gradients / MiB:.0f} MiB of "
        f"gradients; NCCL's own buffers lie outside PyTorch's allocator and are not counted"
    )


def _norm_text(model_cfg: ModelConfig) -> str:
    if model_cfg.norm == "sync":  # the same tensors saved per layer; its all-reduced statistics are 2C+1 floats
        return "sync (estimated as BatchNorm on this process's micro-batch)"
    return model_cfg.norm


def nothing_fits(
    cfg: Config, step: LoopStep, frames: int, one_clip: int, usable: int, budget: float, cuda: bool, shape: dict
) -> str:
    """The one-line error when even 1 clip does not fit: which switch would, each with its estimate."""
    data, model_cfg, train_cfg = cfg.data, cfg.model, cfg.train
    height, width = data.img_size
    options = []
    if not model_cfg.recompute_blocks:
        options.append(("model.recompute_blocks: true", derive(cfg, {"model.recompute_blocks": True}, WHY), frames))
    chunk = 16 if frames > 16 else None
    if chunk and (train_cfg.chunk_train_size == -1 or train_cfg.chunk_train_size > chunk):
        chunked = derive(cfg, {"train.chunk_train_size": chunk, "train.chunk_train_overlap": 0}, WHY)
        options.append((f"train.chunk_train_size: {chunk}", chunked, frames))
    if frames > 1:
        options.append((f"data.num_frames: {frames // 2}", cfg, frames // 2))
    smaller = [max(1, height * 3 // 4), max(1, width * 3 // 4)]
    options.append((f"data.img_size: {smaller}", derive(cfg, {"data.img_size": smaller}, WHY), frames))
    parts = []
    for name, changed, clip in options:
        peak = config_training_estimate(changed, step, clip, 1, **shape).peak
        parts.append(f"{name} {peak / GiB:.2f} GiB{' (fits)' if peak <= usable else ''}")
    return (
        f"data.batch_size: even 1 clip of {frames} frames at {height}x{width} is estimated at "
        f"{one_clip / GiB:.2f} GiB, over the {margin_text(budget, cuda)}. Estimated for 1 clip with one change: "
        + "; ".join(parts)
    )
