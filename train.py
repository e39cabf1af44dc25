"""Train a video classifier inside a fixed memory budget.

    python train.py --config configs/rtx5080.yaml --use_amp
    python train.py --config configs/quickstart.yaml --set data.batch_size=4 --resume auto
    torchrun --nproc_per_node=2 train.py --config configs/rtx4090.yaml

A hand-written loop: ``train_one_epoch`` and ``evaluate`` return dicts of plain floats; ``main`` wires.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm

import memory_estimate
import memory_monitor
import plots
from atomic_files import atomic_write_bytes, remove_stale_temp_files
from checkpoint import (CheckpointError, TrainState, make_run_dir, point_latest_to,
                        restore_rng_state, restore_training, save_checkpoint, save_epoch_links, training_checkpoint,
                        unwrap_model)
from chunked_forward import (ChunkedTrainingForward, ChunkSpec, aggregate_chunk_logits, chunk_labels, chunk_windows,
                             clip_length, forward_chunked)
from cli import add_config_arguments, exit_on_usage_error
from config import ConfigError, dump, load_config
from datasets.video_dataset import (BAD_INPUT_ERRORS, DATA_LAYOUTS, BadInputReport, before_workers_fork,
                                    build_dataset, collate_samples, index_cache_for, read_split, resolve_class_names,
                                    training_records, worker_init)
from datasets.sampler import EpochSampler
from datasets.transforms import InputPreparer
from metrics import ClassificationMeter, CsvLog
from models import ModelConfigError, build_model
from runtime import Runtime, setup_logging, setup_runtime

log = logging.getLogger("longvideo")  # set up by main(): importing train (eval.py does) configures nothing


def make_loader(dataset, cfg: dict, runtime: Runtime, batch_size: int, shuffle: bool, pad: bool) -> DataLoader:
    """shuffle: a new permutation every epoch (training); pad: equal shards for every rank (training, where DDP
    needs equal step counts; evaluation shards are not padded, so no sample counts twice)."""
    data = cfg["data"]
    sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=cfg["train"]["seed"], rank=runtime.rank,
                           world_size=runtime.world_size, pad=pad)
    before_workers_fork(data["num_workers"])
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                      num_workers=data["num_workers"], worker_init_fn=worker_init, collate_fn=collate_samples,
                      pin_memory=data["pin_memory"] and runtime.device.type == "cuda",
                      drop_last=False, persistent_workers=False)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cap_workers(data_cfg: dict) -> None:
    """No more DataLoader workers than cores (a preset for a 16-core workstation on a 2-core laptop): one line,
    instead of PyTorch's warning once per loader. Written into the config, so the run records what ran."""
    cores = available_cores()
    if data_cfg["num_workers"] > cores:
        log.info("data.num_workers=%d but this machine has %d CPU cores: using %d DataLoader workers",
                 data_cfg["num_workers"], cores, cores)
        data_cfg["num_workers"] = cores


def build_optimizer(model: torch.nn.Module, train_cfg: dict) -> torch.optim.Optimizer:
    # no weight decay on norms and biases (the usual practice for CNNs and transformers)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": train_cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    if train_cfg["optimizer"] == "sgd":
        return torch.optim.SGD(groups, lr=train_cfg["lr"], momentum=train_cfg["momentum"], nesterov=True)
    return torch.optim.AdamW(groups, lr=train_cfg["lr"])


def build_scheduler(optimizer, train_cfg: dict, steps_per_epoch: int, max_epochs: int):
    """Linear warm-up, then cosine decay to min_lr, stepped once per optimizer step."""
    total = max(1, steps_per_epoch * max_epochs)
    warmup = int(round(train_cfg["warmup_epochs"] * steps_per_epoch))
    floor = train_cfg["min_lr"] / train_cfg["lr"] if train_cfg["lr"] > 0 else 0.0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class RunReport:
    """What a run tells besides its checkpoints and metrics: the log file, memory.csv, the skipped files, the clock."""
    log_file: logging.Handler | None = None  # <run>/train.log: what the console shows, with timestamps
    memory_log: CsvLog | None = None  # memory.csv
    bad_inputs: BadInputReport | None = None  # skipped files and data warnings, reported once per run
    started: float = field(default_factory=time.time)
    last_progress: float = field(default_factory=time.time)  # the last progress line's time


@dataclass
class Trainer:
    """What every step needs, built once in main()."""
    model: torch.nn.Module  # a ChunkedTrainingForward around the classifier, possibly DDP-wrapped
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    prepare: InputPreparer
    runtime: Runtime
    cfg: dict
    run_dir: str
    class_names: list
    data_info: dict
    criterion: torch.nn.Module
    state: TrainState
    pending_rng: dict | None = None
    stop_after_steps: int | None = None
    report: RunReport = field(default_factory=RunReport)

    def checkpoint_dict(self) -> dict:
        return training_checkpoint(self.model, self.optimizer, self.scheduler, self.scaler, self.state, self.cfg,
                                   self.class_names, self.data_info)

    def chunk_spec(self) -> ChunkSpec:
        """The training chunks now: the config's, or the shorter ones the OOM back-off chose."""
        train_cfg = self.cfg["train"]
        size = train_cfg["chunk_train_size"] if self.state.chunk_train_size is None else self.state.chunk_train_size
        overlap = train_cfg["chunk_train_overlap"]
        if size != -1 and overlap >= size:  # a chunk shortened by the back-off keeps half of itself shared at most
            overlap = size // 2
        return ChunkSpec(size, overlap)

    def save(self, name: str) -> str:
        path = os.path.join(self.run_dir, "checkpoints", name)
        if self.runtime.is_main:
            save_checkpoint(self.checkpoint_dict(), path)
            point_latest_to(self.run_dir)  # only a run with a checkpoint becomes "latest"
        return path


class NonFiniteLossError(RuntimeError):
    pass


OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def train_one_epoch(trainer: Trainer, loader: DataLoader) -> dict:
    state, runtime = trainer.state, trainer.runtime
    accumulate = trainer.cfg["train"]["accumulate_grad_batches"]
    trainer.model.train()
    num_batches = len(loader) + state.batches_done
    iterator = _iterate_resumed(trainer, loader)
    totals = {"clips": 0, "data_time": 0.0}  # of this call (speed); the epoch's loss is kept in the state
    start = time.perf_counter()
    progress = tqdm(total=num_batches, initial=state.batches_done, desc=f"epoch {state.epoch + 1}",
                    disable=not (runtime.is_main and sys.stderr.isatty()), leave=False)
    trainer.optimizer.zero_grad(set_to_none=True)
    group_start = state.batches_done - state.batches_done % accumulate
    group: list[dict] = []  # the loader batches of this accumulation group, kept to replay it after an OOM
    mid_epoch_memory = None  # for the leak check: returned, popped by fit()
    for batch_index in range(state.batches_done, num_batches):
        tick = time.perf_counter()
        batch = _next_batch(iterator)
        totals["data_time"] += time.perf_counter() - tick
        if trainer.report.bad_inputs is not None:
            trainer.report.bad_inputs.take(batch)
        group_size = min(accumulate, num_batches - group_start)
        need_update = batch_index + 1 == group_start + group_size
        group.append(batch)
        loss_sum, clips = _accumulate_with_oom_backoff(trainer, group, group_size, need_update)
        if batch_index == num_batches // 2:  # the same point of every epoch, workers alive: for the leak check
            mid_epoch_memory = memory_monitor.snapshot(runtime.device)
        totals["clips"] += _count_loss(trainer, loss_sum, clips)
        if need_update:
            _optimizer_step(trainer)
            group_start, group = batch_index + 1, []
        state.batches_done = batch_index + 1
        progress.update(1)
        _stop_after_nonfinite_losses(trainer)
        if need_update:
            _after_step(trainer, totals, start, progress)
            if trainer.stop_after_steps and state.global_step >= trainer.stop_after_steps:
                break
    progress.close()
    elapsed = time.perf_counter() - start
    if trainer.report.bad_inputs is not None:
        trainer.report.bad_inputs.end_epoch(state.epoch + 1)
    return {"train_loss": state.epoch_loss_sum / max(state.epoch_clips, 1), "train_clips_per_s": totals["clips"] / elapsed,
            "data_time_share": totals["data_time"] / elapsed, "lr": trainer.scheduler.get_last_lr()[0],
            "skipped_steps": state.skipped_steps, "clips_per_forward": _clips_per_forward(trainer),
            "chunk_train_size": trainer.chunk_spec().size, "memory": mid_epoch_memory}


STOP_REQUESTED = threading.Event()  # set by the first Ctrl-C (see stop_on_ctrl_c)


@contextlib.contextmanager
def stop_on_ctrl_c():
    """Ctrl-C during training: the first one asks the loop to stop after the current batch (checked between
    batches and epochs, where raising cannot be lost: a KeyboardInterrupt raised inside a finalizer, such as the
    previous epoch's DataLoader iterator shutting its workers down, is printed and dropped by Python), a second
    one stops at once."""
    def request_stop(signum, frame):
        if STOP_REQUESTED.is_set():
            raise KeyboardInterrupt
        STOP_REQUESTED.set()
        log.warning("Ctrl-C: stopping after this batch and saving last.pt (Ctrl-C again to stop at once)")

    STOP_REQUESTED.clear()
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        yield
        return
    previous = signal.signal(signal.SIGINT, request_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop_if_asked() -> None:
    if STOP_REQUESTED.is_set():
        raise KeyboardInterrupt


def _next_batch(iterator):
    """The next loader batch; after a Ctrl-C the workers (which got it too) may be gone: stop, do not crash."""
    _stop_if_asked()
    try:
        return next(iterator)
    except RuntimeError:
        _stop_if_asked()
        raise


def _iterate_resumed(trainer: Trainer, loader: DataLoader):
    """iter(loader), with a resumed run's RNG state restored where the uninterrupted run had it: the state saved
    at an epoch's end is the one the next epoch's iter(loader) drew its worker seed from, so it is restored
    before that draw; one saved mid-epoch was taken after it."""
    pending, trainer.pending_rng = trainer.pending_rng, None
    if pending is not None and trainer.state.batches_done == 0:
        restore_rng_state(pending)
        pending = None
    iterator = iter(loader)
    if pending is not None:
        restore_rng_state(pending)
    return iterator


def _count_loss(trainer: Trainer, loss_sum: float, clips: int) -> int:
    """A batch's loss into the epoch's, non-finite ones counted in a row; returns the clips counted."""
    state = trainer.state
    if math.isfinite(loss_sum):
        state.nonfinite_streak = 0
        state.epoch_loss_sum += loss_sum
        state.epoch_clips += clips
        return clips
    state.nonfinite_streak += 1
    return 0


def _stop_after_nonfinite_losses(trainer: Trainer) -> None:
    """trainer.max_nonfinite_steps non-finite losses in a row stop the run, with last.pt saved."""
    state = trainer.state
    if state.nonfinite_streak >= trainer.cfg["trainer"]["max_nonfinite_steps"]:
        path = trainer.save("last.pt")
        raise NonFiniteLossError(
            f"{state.nonfinite_streak} consecutive non-finite losses at step {state.global_step}; saved "
            f"{path}. Lower train.lr, use trainer.precision: bf16 or 32 instead of 16, or set train.grad_clip")


def _accumulate_with_oom_backoff(trainer: Trainer, group: list[dict], group_size: int, need_update: bool):
    """Forward and backward of the newest batch of ``group``; after an out-of-memory error, the micro-batch is
    halved (each loader batch split in two more pieces, so the effective batch stays the same) and the whole
    group is replayed, since its gradients so far were dropped with the failed step."""
    replay = False
    while True:
        failed = False
        try:
            for batch in (group if replay else group[-1:]):
                result = _forward_backward(trainer, batch, group_size, sync=need_update and batch is group[-1])
            return result
        except OutOfMemoryError:
            failed = True
        if failed:  # outside the except block: its traceback no longer holds the step's tensors
            _back_off_after_oom(trainer, len(group[-1]["label"]), clip_length(group[-1]))
            replay = True


def _forward_backward(trainer: Trainer, batch: dict, group_size: int, sync: bool) -> tuple[float, int]:
    """One loader batch in ``state.micro_splits`` pieces; returns (sum of the clip losses, clips)."""
    model, runtime = trainer.model, trainer.runtime
    size = len(batch["label"])
    keys = [k for k in MODEL_KEYS if k in batch]
    pieces = [dict(zip(keys, parts)) for parts in zip(*(torch.tensor_split(batch[k], trainer.state.micro_splits)
                                                         for k in keys)) if len(parts[0])]
    spec = trainer.chunk_spec()
    loss_sum = 0.0
    for i, piece in enumerate(pieces):
        inputs = trainer.prepare.transfer(piece)  # frames stay uint8 until their chunk runs
        clips = len(piece["label"])
        # DDP: all-reduce gradients only on the last piece of the micro-batch that steps (no_sync on the others)
        context = model.no_sync() if runtime.distributed and not (sync and i == len(pieces) - 1) else contextlib.nullcontext()
        with context:
            with runtime.autocast():
                loss = training_loss(model(inputs, spec), piece, spec, trainer.cfg["train"], trainer.criterion)
            # a piece's mean loss weighted by its share of the batch, over the group: the group's mean loss
            trainer.scaler.scale(loss * (clips / size) / group_size).backward()
        loss_sum += float(loss.detach()) * clips
    return loss_sum, size


def training_loss(chunk_logits: torch.Tensor, piece: dict, spec: ChunkSpec, train_cfg: dict,
                  criterion: torch.nn.Module) -> torch.Tensor:
    """train.chunk_loss clip: the aggregated chunk logits against the clip label (the plain loss for one
    chunk); dense: each chunk against the label covering most of its frames, chunks no segment covers left
    out, averaged over the chunks that count."""
    device = chunk_logits.device
    if train_cfg["chunk_loss"] == "clip":
        logits = aggregate_chunk_logits(chunk_logits, train_cfg["chunk_train_aggregation"])
        return criterion(logits, piece["label"].to(device, non_blocking=True))
    if "frame_labels" not in piece:
        raise ConfigError("train.chunk_loss: dense needs the samples' frame_labels (the dataset provides them); "
                          "use chunk_loss: clip")
    windows = chunk_windows(clip_length(piece), spec.size, spec.overlap)
    labels = chunk_labels(piece["frame_labels"], windows).to(device)  # [n, B]
    counted = labels >= 0
    if not counted.any():  # no chunk of this piece lies in a segment: nothing to learn, no NaN either
        return chunk_logits.sum() * 0.0
    return criterion(chunk_logits[counted], labels[counted])


MODEL_KEYS = ("label", "video", "kpt", "frame_labels")
PROGRESS_EVERY_S = 60.0


def _clips_per_forward(trainer: Trainer) -> int:
    return math.ceil(trainer.cfg["data"]["batch_size"] / trainer.state.micro_splits)


class OutOfMemoryAdvice(RuntimeError):
    pass


def _back_off_after_oom(trainer: Trainer, batch_size: int, length: int) -> None:
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
        path = trainer.save("last.pt")
        data, model = cfg["data"], cfg["model"]
        raise OutOfMemoryAdvice(
            f"out of memory with 1 clip per forward pass in chunks of {_frames(_chunk_frames(trainer, length))} "
            f"(the model's shortest); "
            f"saved {path}. To fit, in this order: "
            f"1) smaller frames (data.img_size={data['img_size']}), "
            f"2) model.grad_checkpointing: true (now {str(model['grad_checkpointing']).lower()}), "
            f"3) trainer.precision 16/bf16 (now {trainer.runtime.precision}), "
            f"4) a smaller model or preset (configs/gtx1650.yaml)")
    state.micro_splits *= 2
    log.warning("out of memory at %d clips per forward: now %d per forward, %d forwards per batch of %d and %d "
                "batches per step (the effective batch is unchanged); the step is retried", per_forward,
                math.ceil(batch_size / state.micro_splits), state.micro_splits, batch_size,
                cfg["train"]["accumulate_grad_batches"])


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


def _optimizer_step(trainer: Trainer) -> None:
    optimizer, scaler, state = trainer.optimizer, trainer.scaler, trainer.state
    grad_clip = trainer.cfg["train"]["grad_clip"]
    if grad_clip is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), grad_clip)
    if scaler.is_enabled():
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        stepped = scaler.get_scale() >= scale_before  # a lowered scale means inf/NaN gradients: step skipped
    else:
        grads_finite = all(p.grad is None or torch.isfinite(p.grad).all() for p in trainer.model.parameters())
        stepped = grads_finite and state.nonfinite_streak == 0
        if stepped:
            optimizer.step()
    if not stepped:
        state.skipped_steps += 1
        log.warning("step %d skipped: non-finite loss or gradients (%d skipped so far)", state.global_step,
                    state.skipped_steps)
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # a step skipped for inf/NaN gradients still advances the schedule (it counts optimizer steps); torch
        # warns about a scheduler step before any optimizer step, which is then expected
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        trainer.scheduler.step()
    state.global_step += 1


def _after_step(trainer: Trainer, totals: dict, start: float, progress) -> None:
    state, train_cfg, runtime = trainer.state, trainer.cfg["train"], trainer.runtime
    every = train_cfg["checkpoint_every_steps"]
    if every and state.global_step % every == 0:
        trainer.save("last.pt")
    due = (state.global_step % train_cfg["log_every"] == 0
           or time.time() - trainer.report.last_progress >= PROGRESS_EVERY_S)  # a line a minute at least: nohup/cron logs
    if due and runtime.is_main:
        trainer.report.last_progress = time.time()
        snap = memory_monitor.snapshot(runtime.device)
        elapsed = time.perf_counter() - start
        loss = state.epoch_loss_sum / max(state.epoch_clips, 1)
        progress.set_postfix_str(f"loss {loss:.3f} {memory_monitor.compact(snap)}")
        log.info("epoch %d step %d (%d/%d) loss %.4f lr %.2e clips/s %.1f data %.0f%% %s", state.epoch + 1,
                 state.global_step, state.batches_done, progress.total, loss, trainer.scheduler.get_last_lr()[0],
                 totals["clips"] / elapsed, 100 * totals["data_time"] / elapsed, memory_monitor.compact(snap))
        if trainer.report.memory_log is not None:
            trainer.report.memory_log.write({"epoch": state.epoch + 1, "step": state.global_step, **snap})


@torch.inference_mode()
def evaluate(model: torch.nn.Module, loader: DataLoader, prepare: InputPreparer, runtime: Runtime,
             train_cfg: dict, num_classes: int, bad_inputs: BadInputReport | None = None,
             meter: ClassificationMeter | None = None, on_clips=None) -> dict:
    """Clip- and video-level metrics with the shared chunked forward; predictions move to the CPU at once.
    The one evaluation loop: training's validation and eval.py (which passes its own ``meter``, for the
    per-video rows, and ``on_clips(batch, logits)`` for the per-clip ones).

    Under DDP each rank evaluates its shard and the CPU meters are gathered, so every rank gets the metrics
    of the whole validation set.
    """
    model = unwrap_model(model)  # no DDP collectives here: shards may differ in length
    model.eval()
    meter = meter if meter is not None else ClassificationMeter(num_classes)
    for batch in loader:
        if bad_inputs is not None:
            bad_inputs.take(batch)
        with runtime.autocast():
            logits = forward_chunked(model, prepare(batch), train_cfg["chunk_infer_size"], train_cfg["chunk_overlap"],
                                     train_cfg["chunk_aggregation"], train_cfg["video_batch_size"])
        logits = logits.float().cpu()
        meter.update(logits, batch["label"], batch["video_index"])
        if on_clips is not None:
            on_clips(batch, logits)
    if runtime.distributed:
        meters = [None] * runtime.world_size
        torch.distributed.all_gather_object(meters, meter)
        meter = ClassificationMeter.merged(meters)
    return meter.compute()


# ------------------------------------------------------------------------------------------------- wiring

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--resume", metavar="auto|PATH",
                        help="continue a run: auto = last.pt of runs/<experiment>/latest, or a checkpoint path")
    parser.add_argument("--device", help="override trainer.device (auto, cpu, cuda, cuda:N)")
    parser.add_argument("--probe-memory", action="store_true",
                        help="estimate (on any machine; with CUDA also measure) the peak device memory of one "
                             "training step over a grid of num_frames x batch_size, print the largest batch that "
                             "fits trainer.memory_budget_gb, and exit")
    parser.add_argument("--probe-frames", metavar="N,N,...", help="num_frames values of the probe grid")
    parser.add_argument("--probe-batches", metavar="N,N,...", help="batch sizes of the probe grid")
    parser.add_argument("--fit-budget", action="store_true",
                        help="before training, pick the largest micro-batch whose estimated memory fits "
                             "trainer.memory_budget_gb and keep the global batch by accumulation (as "
                             "data.batch_size: auto does)")
    parser.add_argument("--stop-after-steps", type=int, metavar="N",
                        help="stop after N optimizer steps (saving last.pt): smoke tests and quick checks")
    return parser.parse_args(argv)


def probe_memory(cfg: dict, device: str | None, frames_arg: str | None, batches_arg: str | None) -> int:
    """--probe-memory: estimated (and with CUDA measured) peak memory per num_frames x batch_size, and the
    largest batch that fits the budget (memory_estimate.py)."""
    def grid(text):
        try:
            return sorted({int(v) for v in text.split(",")}) if text else None
        except ValueError:
            raise ConfigError(f"--probe-frames/--probe-batches: {text!r} is not a comma-separated list of integers")
    for_gpu = (device or cfg["trainer"]["device"]) != "cpu"  # the budget of a GPU (its context set aside)
    if cfg["trainer"]["precision"] == "amp":
        cfg["trainer"]["precision"] = "16"  # what --use_amp means on a GPU, which the estimate is for
    shape = data_shapes(cfg)
    return memory_estimate.probe(cfg, for_gpu and torch.cuda.is_available(), grid(frames_arg), grid(batches_arg),
                                 out=lambda line: print(line, flush=True), for_gpu=for_gpu, **shape)


def data_shapes(cfg: dict) -> dict:
    """Views, keypoint shape and class count of the training data, from its manifest (no video is opened): what
    the memory estimate needs to build the model and its inputs. The model's defaults where it cannot be read."""
    from datasets.keypoints import read_keypoints
    try:
        records = read_split(cfg["data"], "train")
        kpt = (tuple(read_keypoints(records[0].keypoints, [0]).shape[1:]) if cfg["data"]["load_kpt"]
               and records[0].keypoints else None)
        return {"num_views": len(records[0].views), "kpt_shape": kpt,
                "num_classes": len(resolve_class_names(cfg["data"], records))}
    except BAD_INPUT_ERRORS + (OSError, IndexError) as e:
        views = 1 if cfg["model"]["view_fusion"] == "none" else 3
        log.warning("the training manifest cannot be read (%s): estimating for %d view(s), keypoints [17, 3], "
                    "10 classes", str(e).splitlines()[0], views)
        return {"num_views": views, "kpt_shape": (17, 3) if cfg["data"]["load_kpt"] else None, "num_classes": 10}


def fit_budget(cfg: dict, runtime: Runtime, shape: dict) -> None:
    """data.batch_size: auto (or --fit-budget): the largest micro-batch whose estimate fits the budget, and the
    accumulation that keeps the global batch (train.global_batch_size, or batch x accumulation as written).
    Written into cfg, so the run's config.yaml and checkpoints hold the decision."""
    data, train_cfg, budget = cfg["data"], cfg["train"], cfg["trainer"]["memory_budget_gb"]
    cuda = runtime.device.type == "cuda"
    usable = memory_estimate.usable_bytes(budget, cuda)
    frames = memory_estimate.clip_frames(cfg)
    fitting, tried = memory_estimate.largest_batch(cfg, frames, usable, **shape)
    if not fitting:
        raise ConfigError(memory_estimate.nothing_fits(cfg, frames, tried[0][1].peak, usable, budget, cuda, shape))
    global_batch = train_cfg["global_batch_size"]
    if global_batch is None and data["batch_size"] != "auto":
        global_batch = data["batch_size"] * train_cfg["accumulate_grad_batches"] * runtime.world_size
    if global_batch is None:  # batch_size: auto without a global batch: the accumulation stays as written
        batch, accumulate = fitting, train_cfg["accumulate_grad_batches"]
    else:
        if global_batch % runtime.world_size:
            raise ConfigError(f"train.global_batch_size={global_batch} must be a multiple of the {runtime.world_size} "
                              f"processes")
        per_process = global_batch // runtime.world_size
        batch = max(b for b in range(1, min(fitting, per_process) + 1) if per_process % b == 0)
        accumulate = per_process // batch
    estimate = next((e for b, e in tried if b == batch), None) or memory_estimate.config_training_estimate(
        cfg, frames, batch, **shape)
    data["batch_size"], train_cfg["accumulate_grad_batches"] = batch, accumulate
    log.info("memory budget: batch %d x %d accumulated x %d processes (largest batch that fits: %d), estimated "
             "peak %.2f GiB of %s", batch, accumulate, runtime.world_size, fitting, estimate.peak / 2 ** 30,
             memory_estimate.margin_text(budget, cuda))


def refuse_gpu_preset_without_cuda(cfg: dict, config_path: str | None, device: str | None) -> None:
    """A preset sized for a GPU (trainer.memory_budget_gb, device auto or cuda) on a machine without CUDA would
    train for hours on the CPU without a word: stop at once, unless --device cpu says that is meant."""
    budget, wanted = cfg["trainer"]["memory_budget_gb"], device or cfg["trainer"]["device"]
    if budget and wanted != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"{config_path or 'the config'}: this machine has no CUDA device, and the preset is for a "
                          f"{budget:g} GB GPU (trainer.memory_budget_gb); use configs/cpu.yaml, or add --device cpu "
                          f"to run it on the CPU anyway")


def attach_run_log(run_dir: str) -> logging.Handler:
    """<run>/train.log: every line the console shows, with its time (appended on resume)."""
    handler = logging.FileHandler(os.path.join(run_dir, "train.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return handler


def save_after_interrupt(trainer: Trainer, args) -> int:
    """Ctrl-C: last.pt at the last optimizer step (the unfinished accumulation group is trained again on
    resume), how to continue, exit code 130 (the shell's code for SIGINT)."""
    state = trainer.state
    state.batches_done -= state.batches_done % trainer.cfg["train"]["accumulate_grad_batches"]
    path = trainer.save("last.pt")
    command = " ".join(["python", "train.py"] + (["--config", args.config] if args.config else [])
                       + [f"--set {item}" for item in args.overrides] + ["--resume", "auto"])
    log.warning("interrupted at epoch %d, step %d: saved %s; continue with: %s", state.epoch + 1,
                state.global_step, path, command)
    return 130


def refuse_demo_data_for_gpu_preset(cfg: dict, origins: dict, config_path: str | None) -> None:
    """A GPU preset names no data of its own: without data.data_dir set (in the user's preset or by --set) it
    would train on the demo's synthetic clips without a word."""
    origin = origins.get("data.data_dir", "defaults")
    if cfg["trainer"]["memory_budget_gb"] and (origin == "defaults" or os.path.basename(origin) == "base.yaml"):
        raise ConfigError(f"{config_path or 'the config'}: data.data_dir is not set, and a GPU preset does not fall "
                          f"back to the demo's {cfg['data']['data_dir']}: set data.data_dir (and data.train_manifest, "
                          f"data.val_manifest or data.val_fraction) to your data, e.g. --set data.data_dir=/data/clips; "
                          f"a manifest may be {DATA_LAYOUTS}")


def find_resume_checkpoint(resume: str, cfg: dict) -> str:
    if resume != "auto":
        if not os.path.exists(resume):
            raise ConfigError(f"--resume {resume}: checkpoint not found")
        return resume
    path = os.path.join(cfg["trainer"]["output_dir"], cfg["experiment"], "latest", "checkpoints", "last.pt")
    if not os.path.exists(path):
        raise ConfigError(f"--resume auto: no {path} to continue from; start without --resume, or give a "
                          f"checkpoint path")
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    origins: dict[str, str] = {}
    cfg = load_config(args.config, args.overrides, args.use_amp, origins)
    if args.print_config:
        print(dump(cfg), end="")
        return 0
    if args.probe_memory:  # before the runtime: nothing of this machine's is used unless it has CUDA
        return probe_memory(cfg, args.device, args.probe_frames, args.probe_batches)
    refuse_gpu_preset_without_cuda(cfg, args.config, args.device)
    refuse_demo_data_for_gpu_preset(cfg, origins, args.config)
    resume_path = find_resume_checkpoint(args.resume, cfg) if args.resume else None
    runtime = setup_runtime(cfg["trainer"], device=args.device)
    setup_logging(runtime.is_main)
    trainer, train_loader, val_loader = build_trainer(cfg, runtime, resume_path, args.stop_after_steps,
                                                      args.fit_budget)
    try:
        with stop_on_ctrl_c():
            fit(trainer, train_loader, val_loader)
    except (NonFiniteLossError, OutOfMemoryAdvice) as e:
        log.error("error: %s", e)
        return 1
    except KeyboardInterrupt:
        return save_after_interrupt(trainer, args)
    finally:
        if trainer.report.log_file is not None:
            log.removeHandler(trainer.report.log_file)
            trainer.report.log_file.close()
        if runtime.distributed:
            torch.distributed.destroy_process_group()
    return 0


def build_trainer(cfg: dict, runtime: Runtime, resume_path: str | None = None, stop_after_steps: int | None = None,
                  fit_to_budget: bool = False) -> tuple[Trainer, DataLoader, DataLoader | None]:
    """Data, model, optimizer, schedule and run directory (or the resumed ones), wired into a Trainer."""
    torch.manual_seed(cfg["train"]["seed"])
    np.random.seed(cfg["train"]["seed"])
    train_set, val_set, class_names, data_info = build_data(cfg)
    if fit_to_budget or cfg["data"]["batch_size"] == "auto":  # the same decision again on resume: deterministic
        fit_budget(cfg, runtime, {"num_views": data_info["num_views"], "kpt_shape": data_info["kpt_shape"],
                                  "num_classes": len(class_names)})
    model, channels_last = _model_on_device(cfg, runtime, len(class_names), data_info)
    cap_workers(cfg["data"])
    train_loader = make_loader(train_set, cfg, runtime, cfg["data"]["batch_size"], shuffle=True, pad=True)
    val_loader = (make_loader(val_set, cfg, runtime, 1, shuffle=False, pad=False)  # clips vary in length
                  if val_set is not None else None)
    optimizer = build_optimizer(model, cfg["train"])
    steps_per_epoch = math.ceil(len(train_loader) / cfg["train"]["accumulate_grad_batches"])
    scheduler = build_scheduler(optimizer, cfg["train"], steps_per_epoch, cfg["trainer"]["max_epochs"])
    scaler = runtime.grad_scaler()
    state, pending_rng, run_dir = TrainState(), None, None
    if resume_path:
        state, pending_rng, run_dir = restore_training(resume_path, model, optimizer, scheduler, scaler)
        if run_dir is None:  # a checkpoint from elsewhere: nothing is written beside the user's file
            log.info("%s is not inside a run directory of this project (<run>/checkpoints/, with config.yaml): "
                     "continuing in a new run directory", resume_path)
    if run_dir is None:
        run_dir = make_run_dir(cfg) if runtime.is_main else ""
    prepare = InputPreparer(runtime.device, cfg["data"]["mean"], cfg["data"]["std"], channels_last)
    wrapped = ChunkedTrainingForward(torch.compile(model) if cfg["trainer"]["compile"] else model, prepare.normalize)
    if runtime.distributed:
        wrapped = DistributedDataParallel(wrapped, device_ids=[runtime.device.index] if runtime.device.type == "cuda"
                                          else None)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg["train"]["label_smoothing"])
    trainer = Trainer(model=wrapped, optimizer=optimizer, scheduler=scheduler, scaler=scaler, prepare=prepare,
                      runtime=runtime, cfg=cfg, run_dir=run_dir, class_names=class_names, data_info=data_info,
                      criterion=criterion, state=state, pending_rng=pending_rng, stop_after_steps=stop_after_steps,
                      report=RunReport(bad_inputs=BadInputReport(train_set, val_set)))
    if runtime.is_main:
        _start_run_files(trainer, len(train_set))
    return trainer, train_loader, val_loader


def build_data(cfg: dict) -> tuple:
    """(training set, validation set or None, class names, the data's shape: views and keypoints)."""
    index_cache = index_cache_for(cfg)
    train_records, val_records = training_records(cfg["data"])
    class_names = resolve_class_names(cfg["data"], train_records)
    train_set = build_dataset(cfg, "train", class_names, training=True, index_cache=index_cache,
                              records=train_records)
    val_set = build_dataset(cfg, "val", class_names, training=False, index_cache=index_cache,
                            records=val_records) if val_records is not None else None
    if cfg["model"]["model_class_num"] not in (None, len(class_names)):
        raise ConfigError(f"model.model_class_num={cfg['model']['model_class_num']} but the data has "
                          f"{len(class_names)} classes ({', '.join(class_names)}); set it to null or fix the data")
    data_info = {"num_views": len(train_set.view_names), "view_names": train_set.view_names,
                 "kpt_shape": train_set.keypoint_shape()}
    return train_set, val_set, class_names, data_info


def _model_on_device(cfg: dict, runtime: Runtime, num_classes: int, data_info: dict) -> tuple:
    """(the classifier on the device, whether it is in channels_last_3d)."""
    try:
        model = build_model(cfg["model"], num_classes, data_info["num_views"], data_info["kpt_shape"])
    except ModelConfigError as e:  # a model section that does not fit the data or the backbone
        raise ConfigError(str(e))
    model.to(runtime.device)
    channels_last = cfg["trainer"]["channels_last_3d"] and runtime.device.type == "cuda"
    if channels_last:
        model = model.to(memory_format=torch.channels_last_3d)
    return model, channels_last


def _start_run_files(trainer: Trainer, num_samples: int) -> None:
    """train.log, stale temporary files removed, the resolved config.yaml, memory.csv, the run's first line."""
    run_dir, cfg, runtime = trainer.run_dir, trainer.cfg, trainer.runtime
    trainer.report.log_file = attach_run_log(run_dir)
    removed = remove_stale_temp_files(run_dir, recursive=True)
    if removed:
        log.warning("removed %d temporary file(s) left by writers that were killed: %s", len(removed),
                    ", ".join(removed))
    atomic_write_bytes(os.path.join(run_dir, "config.yaml"),
                       dump({**cfg, "trainer": {**cfg["trainer"], "precision": runtime.precision}}).encode())
    trainer.report.memory_log = CsvLog(os.path.join(run_dir, "memory.csv"))
    global_batch = cfg["data"]["batch_size"] * cfg["train"]["accumulate_grad_batches"] * runtime.world_size
    log.info("run %s | %s on %s, precision %s | %d training samples, %d classes | global batch %d = %d x %d "
             "accumulated x %d processes", run_dir, cfg["model"]["backbone"], runtime.device, runtime.precision,
             num_samples, len(trainer.class_names), global_batch, cfg["data"]["batch_size"],
             cfg["train"]["accumulate_grad_batches"], runtime.world_size)


def fit(trainer: Trainer, train_loader: DataLoader, val_loader: DataLoader | None) -> None:
    cfg, state, runtime = trainer.cfg, trainer.state, trainer.runtime
    max_epochs = cfg["trainer"]["max_epochs"]
    metrics_log = CsvLog(os.path.join(trainer.run_dir, "metrics.csv")) if runtime.is_main else None
    leaks = memory_monitor.LeakDetector(cfg["trainer"]["leak_check_epochs"], cfg["trainer"]["leak_tolerance_mb"])
    confusion = None  # of the last validation, for the plot at the end
    while state.epoch < max_epochs:
        train_loader.dataset.set_epoch(state.epoch)
        train_loader.sampler.set_epoch(state.epoch, start=state.batches_done * cfg["data"]["batch_size"])
        row = {"epoch": state.epoch + 1, **train_one_epoch(trainer, train_loader)}
        mid_epoch_memory = row.pop("memory")
        if trainer.report.memory_log is not None:  # at least one memory row per epoch, whatever train.log_every is
            trainer.report.memory_log.write({"epoch": state.epoch + 1, "step": state.global_step,
                                      **memory_monitor.snapshot(runtime.device)})
        if trainer.stop_after_steps and state.global_step >= trainer.stop_after_steps:
            trainer.save("last.pt")
            log.info("stopped after %d steps (--stop-after-steps); last.pt saved", state.global_step)
            return
        _stop_if_asked()
        if val_loader is not None and _validation_due(cfg, state.epoch):
            metrics = evaluate(trainer.model, val_loader, trainer.prepare, runtime, cfg["train"],
                               len(trainer.class_names), trainer.report.bad_inputs)
            row.update({f"val_{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
            confusion = metrics["confusion"]
        if mid_epoch_memory is not None:
            warning = leaks.observe(mid_epoch_memory)
            if warning:
                log.warning("epoch %d: %s", state.epoch + 1, warning)
        _end_epoch(trainer, row, metrics_log)
    _end_run(trainer, confusion)


def _validation_due(cfg: dict, epoch: int) -> bool:
    """Every trainer.check_val_every_n_epoch epochs, and after the last."""
    return (epoch + 1) % cfg["trainer"]["check_val_every_n_epoch"] == 0 or epoch + 1 == cfg["trainer"]["max_epochs"]


def _end_epoch(trainer: Trainer, row: dict, metrics_log) -> None:
    """The epoch's row into the history and metrics.csv, best.pt if the monitored metric improved, the line."""
    state, cfg = trainer.state, trainer.cfg
    state.epoch += 1
    state.batches_done, state.epoch_loss_sum, state.epoch_clips = 0, 0.0, 0
    row.update(time=time.strftime("%Y-%m-%dT%H:%M:%S"), elapsed_s=round(time.time() - trainer.report.started, 3))
    state.history.append(row)
    improved = cfg["train"]["monitor"] in row and row[cfg["train"]["monitor"]] > state.best_metric
    if improved:
        state.best_metric = row[cfg["train"]["monitor"]]
    if trainer.runtime.is_main:
        _save_epoch(trainer, improved)
        metrics_log.write(row)
        shown = ("train_loss", "train_clips_per_s", "data_time_share", "val_clip_acc", "val_video_acc")
        # top-5 of 5 classes or fewer is always 1: not worth a column then
        shown += ("val_top5",) if len(trainer.class_names) > 5 else ()
        log.info("epoch %d/%d: %s", state.epoch, cfg["trainer"]["max_epochs"], "  ".join(
            f"{k} {row[k]:.4f}" for k in shown if k in row))


def _end_run(trainer: Trainer, confusion: list | None) -> None:
    state, cfg = trainer.state, trainer.cfg
    if trainer.report.bad_inputs is not None:
        trainer.report.bad_inputs.end_run()
    if trainer.runtime.is_main and state.history:
        validated = [row["epoch"] for row in state.history if "val_clip_acc" in row]
        plots.training_plots(trainer.run_dir, trainer.class_names, confusion, cfg["train"]["monitor"],
                             validated[-1] if validated else None)
        log.info("done: best %s %.4f; checkpoints in %s", cfg["train"]["monitor"], state.best_metric,
                 os.path.join(trainer.run_dir, "checkpoints"))


def _save_epoch(trainer: Trainer, improved: bool) -> None:
    trainer.save("last.pt")
    save_epoch_links(trainer.run_dir, trainer.state.epoch, improved, trainer.cfg["train"]["keep_last_k"])


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS + (CheckpointError,))
