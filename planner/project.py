"""The project's training step and inference forward under the estimator (``planner.estimate``), and the
largest batch whose estimate fits a budget. The step is train.py's own (``LoopStep``, handed in by the script: the
planner sits below it), around the engine's training forward and loss.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, NamedTuple

import torch
from torch import nn

from config import Config, DataConfig
from core.runtime import Runtime
from datasets.device_input import DeviceInputs
from datasets.windows import chunk_windows
from engine.training.chunked_forward import ChunkedTrainingForward, ChunkSpec, grad_chunks_of
from engine.training.motion_pretext import objective_forward, objective_losses
from engine.training.oom import GRADIENT_BUCKET_BYTES
from engine.training.optim import build_optimizer, max_grad_norm
from models import build_model, temporal_head_of
from planner.estimate import StepEstimate, estimate_inference, estimate_training_step

log = logging.getLogger("longvideo")


class LoopStep(NamedTuple):
    """train.py's step: ``forward_backward(model, inputs, piece, spec, losses, runtime, scaler, weight)`` (one
    micro-batch) and ``optimizer_step(model, optimizer, scaler, scheduler, max_norm)``, the functions its loop
    calls; the planner runs them on fake tensors (and on a GPU, on real ones)."""

    forward_backward: Callable
    optimizer_step: Callable


class ProjectStep:
    """The training step of a config, as the estimate and the CUDA measurement both run it: the classifier of
    ``build_model``, the chunked training forward (``train.chunk_train_size``), the training loss, the optimizer of
    ``build_optimizer``, and the loop's own ``step``. ``train.chunk_loss: dense`` is run as ``clip`` (the loss sees
    [chunks, batch, classes] logits either way: no memory to speak of). ``kept_chunks``: the last chunks whose
    activations are kept (as many as the budget holds). ``gpu``: the model and its inputs in the memory layout
    train.py gives them on a GPU (trainer.channels_last_3d), as the estimate is for a GPU."""

    def __init__(
        self,
        cfg: Config,
        step: LoopStep,
        num_classes: int = 10,
        num_views: int = 1,
        kpt_shape: tuple | None = None,
        kept_chunks: int = 0,
        gpu: bool = True,
    ):
        train_cfg = cfg.train
        self.channels_last = gpu and cfg.trainer.channels_last_3d
        self.cfg, self.step, self.num_classes = cfg, step, num_classes
        self.num_views, self.kpt_shape = num_views, kpt_shape
        self.spec = ChunkSpec(
            train_cfg.chunk_train_size,
            train_cfg.chunk_train_overlap,
            kept=kept_chunks,
            grad_chunks=grad_chunks_of(train_cfg.grad_chunks),
        )
        clip_loss = dataclasses.replace(train_cfg, chunk_loss="clip")
        self.losses = objective_losses(clip_loss, nn.CrossEntropyLoss())

    def classifier(self) -> nn.Module:
        model = build_model(
            dataclasses.replace(self.cfg.model, pretrained=None), self.num_classes, self.num_views, self.kpt_shape
        )
        return model.to(memory_format=torch.channels_last_3d) if self.channels_last else model

    def inputs(self, frames: int, batch: int, device) -> dict:
        return _step_inputs(self.cfg, frames, batch, self.num_views, self.kpt_shape, device)

    def optimizer(self, classifier: nn.Module, foreach: bool | None = None) -> torch.optim.Optimizer:
        return build_optimizer(classifier, self.cfg.train, foreach)

    def forward_backward(self, classifier: nn.Module, inputs: dict, runtime, scaler, weight: float, device) -> None:
        """train.py's forward and backward of one micro-batch; frames normalized on ``device`` per chunk."""
        data = self.cfg.data
        normalize = DeviceInputs(device, data.mean, data.std, self.channels_last).normalize
        # with train.objective: motion, the clip's copy with the patches pasted is in the estimate too
        forward = objective_forward(
            ChunkedTrainingForward(classifier, normalize, data.frame_stride), self.cfg.train.objective
        )
        model_inputs = {k: v for k, v in inputs.items() if k in ("video", "kpt")}
        self.step.forward_backward(forward, model_inputs, inputs, self.spec, self.losses, runtime, scaler, weight)

    def optimizer_step(self, classifier: nn.Module, optimizer, scaler) -> None:
        """train.py's optimizer step (with a schedule that keeps the rate: it holds no tensor)."""
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        max_norm = max_grad_norm(self.cfg.train, temporal_head_of(classifier) is not None)
        self.step.optimizer_step(classifier, optimizer, scaler, schedule, max_norm)


def config_training_estimate(
    cfg: Config,
    step: LoopStep,
    num_frames: int | None = None,
    batch_size: int | None = None,
    num_classes: int = 10,
    num_views: int = 1,
    kpt_shape: tuple | None = None,
    precision: str | None = None,
    fake: bool = True,
    kept_chunks: int = 0,
    world_size: int = 1,
) -> StepEstimate:
    """One training step of a config as train.py runs it (``ProjectStep``), with the preset's precision,
    recomputed blocks, optimizer and accumulation, the uint8 clip (views, keypoints) on the device,
    ``kept_chunks`` training chunks not recomputed, and with ``world_size`` > 1 the bucket the gradients are
    averaged through (train.ddp_sync: agreed) or DistributedDataParallel's buckets (during_backward)."""
    frames = num_frames or cfg.data.num_frames
    if frames < 1:
        raise ValueError("num_frames -1 (every frame of the window): give the clip length to estimate")
    batch = batch_size or cfg.data.batch_size
    project, device = ProjectStep(cfg, step, num_classes, num_views, kpt_shape, kept_chunks), torch.device("cpu")
    ddp = cfg.train.ddp_sync == "during_backward"

    def forward_backward(classifier, inputs, runtime, scaler, weight):
        project.forward_backward(classifier, inputs, runtime, scaler, weight, device)

    return estimate_training_step(
        lambda: project.classifier().train(),
        lambda: project.inputs(frames, batch, device),
        lambda classifier: project.optimizer(classifier, foreach=True),  # CUDA's implementation and temporaries
        forward_backward,
        project.optimizer_step,
        precision or cfg.trainer.precision,
        cfg.train.accumulate_grad_batches,
        fake=fake,
        average_bucket=GRADIENT_BUCKET_BYTES if world_size > 1 and not ddp else 0,
        ddp_buckets=world_size > 1 and ddp,
    )


def measure_training_step_cuda(
    cfg: Config,
    step: LoopStep,
    num_frames: int,
    batch_size: int,
    num_classes: int = 10,
    num_views: int = 1,
    kpt_shape: tuple | None = None,
    precision: str | None = None,
    kept_chunks: int = 0,
    cap_bytes: int | None = None,
) -> dict | None:
    """The same step on the GPU, really allocated: a warm-up step first (cuDNN's algorithm search with
    ``cudnn.benchmark``, the optimizer state), then the measured one. {"allocated", "reserved"} peak bytes of
    the measured step, or None if it ran out of memory. ``cap_bytes``: the allocator may hold no more than this
    (a smaller card's memory on a larger one: on an uncapped card the allocator keeps what it freed cached, and
    reserved grows past what a card of the budget's size would have run in)."""
    device = torch.device("cuda", torch.cuda.current_device())
    runtime = Runtime(device, precision or cfg.trainer.precision)
    project = ProjectStep(cfg, step, num_classes, num_views, kpt_shape, kept_chunks)
    classifier = optimizer = inputs = None
    if cap_bytes is not None:
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, cap_bytes / torch.cuda.get_device_properties(0).total_memory)
        )
    try:
        classifier = project.classifier().to(device).train()
        optimizer, scaler = project.optimizer(classifier), runtime.grad_scaler()
        inputs = project.inputs(num_frames, batch_size, device)
        weight = 1 / cfg.train.accumulate_grad_batches
        project.forward_backward(classifier, inputs, runtime, scaler, weight, device)
        project.optimizer_step(classifier, optimizer, scaler)
        if cfg.train.accumulate_grad_batches > 1:
            project.forward_backward(classifier, inputs, runtime, scaler, weight, device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        project.forward_backward(classifier, inputs, runtime, scaler, weight, device)
        project.optimizer_step(classifier, optimizer, scaler)
        torch.cuda.synchronize()
        return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        classifier = optimizer = inputs = None  # the step's tensors freed before the cache is emptied
        torch.cuda.empty_cache()
        if cap_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)


def _step_inputs(cfg: Config, frames: int, batch: int, num_views: int, kpt_shape, device) -> dict:
    """A batch as it sits on the device: uint8 frames ([B, (V,) C, T, H, W]), float keypoints, labels."""
    height, width = cfg.data.img_size
    inputs = {"label": torch.zeros(batch, dtype=torch.long, device=device)}
    if cfg.model.input_type in ("rgb", "rgb_kpt"):
        shape = (batch, 3, frames, height, width) if num_views == 1 else (batch, num_views, 3, frames, height, width)
        inputs["video"] = torch.zeros(shape, dtype=torch.uint8, device=device)
    if cfg.model.input_type in ("kpt", "rgb_kpt"):
        inputs["kpt"] = torch.zeros(batch, frames, *(kpt_shape or (17, 3)), device=device)
    return inputs


def largest_batch(
    cfg: Config,
    step: LoopStep,
    num_frames: int,
    usable: int,
    limit: int = 1024,
    line_tries: int | None = None,
    progress=None,
    **shape,
) -> tuple[int, list]:
    """The largest micro-batch whose estimate fits ``usable`` bytes (0 if not even 1; see ``_largest``, which
    ``line_tries`` is passed to), and the (batch, estimate) pairs tried. ``progress(line)``: once an estimate takes
    longer than SLOW_ESTIMATE_S, each one is said as it ends, with how many may follow."""
    tried = []
    say = _Progress(
        progress, usable, 1 + (LINE_TRIES if line_tries is None else line_tries) + math.ceil(math.log2(limit + 1))
    )

    def peak(batch: int) -> int:
        started = time.perf_counter()
        estimate = config_training_estimate(cfg, step, num_frames, batch, **shape)
        tried.append((batch, estimate))
        say(f"largest batch at num_frames={num_frames}: batch {batch}", estimate.peak, started)
        return estimate.peak

    return _largest(peak, usable, limit, line_tries), tried


class _Progress:
    """A search's estimates said as they end (``out``, a line each), once one has taken longer than
    SLOW_ESTIMATE_S: what was estimated, its peak, whether it fits, its seconds, and how many may follow."""

    def __init__(self, out, usable: int, bound: int):
        self.out, self.usable, self.left, self.slow = out, usable, bound, False

    def __call__(self, what: str, peak: int, started: float) -> None:
        took = time.perf_counter() - started
        self.left -= 1
        self.slow = self.slow or took > SLOW_ESTIMATE_S
        if self.out is not None and self.slow:
            fits = "fits" if peak <= self.usable else "does not fit"
            self.out(
                f"  {what} is estimated at {peak / 2**30:.2f} GiB, {fits} ({took:.0f} s; at most {self.left} "
                f"estimates more)"
            )


def graph_chunk_count(cfg: Config, num_frames: int) -> int:
    """The training chunks of a clip of ``num_frames`` frames (train.chunk_train_size, chunk_train_overlap) whose
    forward builds a graph: all of them, or train.grad_chunks (the others hold no activations). These are the
    chunks the memory budget may keep unrecomputed."""
    chunks = len(chunk_windows(num_frames, cfg.train.chunk_train_size, cfg.train.chunk_train_overlap))
    return min(chunks, grad_chunks_of(cfg.train.grad_chunks) or chunks)


def most_chunks_kept(
    cfg: Config, step: LoopStep, num_frames: int, batch_size: int, usable: int, progress=None, **shape
) -> tuple[int, dict]:
    """The most training chunks of a clip (the last ones) whose activations can be kept with the step's estimate
    within ``usable`` bytes (0: every chunk recomputed), and the peaks estimated on the way ({kept: bytes}, the
    answer's among them). The peak grows with every chunk kept: all of them are tried first, then fewer as
    ``_largest`` searches. ``progress``: as ``largest_batch``'s."""
    chunks = graph_chunk_count(cfg, num_frames)
    peaks: dict[int, int] = {}
    say = _Progress(progress, usable, 2 + LINE_TRIES + math.ceil(math.log2(chunks)))

    def peak(kept: int) -> int:
        started = time.perf_counter()
        peaks[kept] = config_training_estimate(cfg, step, num_frames, batch_size, kept_chunks=kept, **shape).peak
        say(f"the chunks kept at batch {batch_size}: keeping {kept} of {chunks}", peaks[kept], started)
        return peaks[kept]

    if peak(chunks) <= usable:
        return chunks, peaks
    kept = _largest(peak, usable, chunks - 1)
    if kept not in peaks:
        peak(kept)
    return kept, peaks


LINE_TRIES = 6  # _largest's estimates guided by the line before it bisects
SLOW_ESTIMATE_S = 5.0  # an estimate slower than this: the search says each one as it ends


def _largest(peak, usable: int, limit: int, line_tries: int | None = None) -> int:
    """The largest n in [1, limit] with peak(n) <= usable (0 if none), for a peak() that grows with n. Each estimate
    costs a traced step, and a step's peak is close to affine in the batch (the weights and optimizer state, then
    each clip's activations), so after 1 and 2 the next n tried is where a line through two estimates crosses
    ``usable`` (the bracket's ends once the answer is bracketed, else the last two): 4 estimates where the peak is
    affine (1, 2, the crossing, the one after it) against 11 for bisection up to 1,024. The line has ``line_tries``
    tries (LINE_TRIES unless given; 0 is bisection alone); where it misleads (rounding to the allocator's blocks, a
    layout that changes with the batch) bisection ends the search, so the answer is exact, bisection's, in at most
    that many more estimates."""
    if limit < 1:
        return 0
    known = {1: peak(1)}
    if known[1] > usable:
        return 0
    tries = LINE_TRIES if line_tries is None else line_tries
    low, high, last = 1, limit + 1, 1  # peak(low) fits; high does not, or is past the limit
    while high - low > 1:
        n = (low + high) // 2
        if tries > 0:
            tries -= 1
            # the line through the bracket's ends once both are known, else through the last two estimates
            a, b = (low, high) if high in known else (last, max((m for m in known if m != last), default=None))
            slope = None if b is None else (known[b] - known[a]) / (b - a)
            if slope is None:
                n = low + 1
            elif slope > 0:  # where the line crosses the budget, kept inside the bracket (low + 1 at least)
                n = min(max(a + math.floor((usable - known[a]) / slope), low + 1), high - 1)
        known[n] = peak(n)
        last = n
        low, high = (n, high) if known[n] <= usable else (low, n)
    return low


# ------------------------------------------------------------------------------- inference: --batch auto


def config_inference_estimate(
    cfg: Config,
    chunk_frames: int,
    chunks: int,
    num_classes: int = 10,
    num_views: int = 1,
    kpt_shape: tuple | None = None,
    precision: str = "32",
    fake: bool = True,
) -> int:
    """Peak device bytes of one inference forward of ``chunks`` inference chunks of ``chunk_frames`` frames, as
    infer_chunked.py runs it: the uint8 chunks on the device, normalized, through the model in eval mode."""
    data, device = cfg.data, torch.device("cpu")
    frames = max(chunk_frames, 1)

    def classifier():
        return build_model(dataclasses.replace(cfg.model, pretrained=None), num_classes, num_views, kpt_shape)

    def make_inputs():
        inputs = _step_inputs(cfg, frames, chunks, num_views, kpt_shape, device)
        return {k: v for k, v in inputs.items() if k != "label"}

    def forward(model, inputs):
        return model(DeviceInputs(device, data.mean, data.std)(inputs))

    return estimate_inference(classifier, make_inputs, forward, precision, fake=fake)


def largest_inference_batch(cfg: Config, chunk_frames: int, usable: int, limit: int = 256, **shape) -> int:
    """The most chunks per forward whose estimate fits ``usable`` bytes (0 if not even 1)."""

    def peak(chunks: int) -> int:
        return config_inference_estimate(cfg, chunk_frames, chunks, **shape)

    return _largest(peak, usable, limit)


def clip_frames(data_cfg: DataConfig) -> int:
    """The clip length to estimate: data.num_frames, or for -1 (every frame of the window) the sample window."""
    frames = data_cfg.num_frames
    if frames > 0:
        return frames
    return data_cfg.max_video_frames or 32
