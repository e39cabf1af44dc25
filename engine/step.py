"""The training step: forward and backward of a micro-batch in its training chunks, gradient accumulation, the
optimizer step, and the out-of-memory back-off. Used by the loop (``engine.loop``) and by the memory planner,
which runs ``step_loss`` on fake tensors.

``Trainer`` is what every step needs, built once by ``engine.loop.build_trainer``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from dataclasses import dataclass, field

import torch

from artifacts.checkpoint import TrainState, training_checkpoint
from artifacts.csv_log import CsvLog
from artifacts.run_dir import RunDirectory
from core.errors import ConfigError
from core.runtime import Runtime, unwrap_model
from datasets.shape import DataShape
from datasets.transforms import InputPreparer
from datasets.video_dataset import BadInputReport
from engine.chunking import ChunkSpec, aggregate_chunk_logits, chunk_labels, chunk_windows, clip_length

log = logging.getLogger("longvideo")


def build_optimizer(model: torch.nn.Module, train_cfg: dict) -> torch.optim.Optimizer:
    """No weight decay on norms and biases (the usual practice for CNNs and transformers). A temporal head's
    parameters form groups of their own at train.lr x train.temporal_lr_scale (the schedule scales every group
    alike); without a head, or with a scale of 1, the model is one pair of groups, as before the scale existed."""
    def decay_groups(name: str, params: list, lr: float) -> list[dict]:
        return [{"params": [p for p in params if p.dim() > 1], "weight_decay": train_cfg["weight_decay"], "lr": lr,
                 "name": name},
                {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": lr, "name": name}]

    trained = [p for p in model.parameters() if p.requires_grad]
    head = getattr(model, "temporal", None)
    if head is None or train_cfg["temporal_lr_scale"] == 1.0:
        groups = decay_groups("model", trained, train_cfg["lr"])
    else:
        in_head = {id(p) for p in head.parameters()}
        groups = (decay_groups("model", [p for p in trained if id(p) not in in_head], train_cfg["lr"])
                  + decay_groups("temporal head", [p for p in trained if id(p) in in_head],
                                 train_cfg["lr"] * train_cfg["temporal_lr_scale"]))
    if train_cfg["optimizer"] == "sgd":
        return torch.optim.SGD(groups, lr=train_cfg["lr"], momentum=train_cfg["momentum"], nesterov=True)
    return torch.optim.AdamW(groups, lr=train_cfg["lr"])


def gradient_clip(train_cfg: dict, has_temporal_head: bool) -> float | None:
    """train.grad_clip, else train.temporal_grad_clip when the model has a temporal head."""
    if train_cfg["grad_clip"] is not None:
        return train_cfg["grad_clip"]
    return train_cfg["temporal_grad_clip"] if has_temporal_head else None


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
    said_head_at_chance: bool = False  # the warning of a temporal head that does not learn, given once a run


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
    run: RunDirectory | None  # None on ranks other than 0: only rank 0 writes
    class_names: list
    shape: DataShape
    criterion: torch.nn.Module
    state: TrainState
    pending_rng: dict | None = None
    pending_advice: Exception | None = None  # DDP: this rank could back off no further; raised at the group's end
    stop_after_steps: int | None = None
    report: RunReport = field(default_factory=RunReport)

    @property
    def has_temporal_head(self) -> bool:
        return getattr(unwrap_model(self.model), "temporal", None) is not None

    @property
    def synced_norm(self) -> bool:
        """SyncBatchNorm under DDP: a collective in every forward (no OOM back-off then)."""
        return self.runtime.distributed and self.cfg["model"]["norm"] == "sync"

    def checkpoint_dict(self) -> dict:
        return training_checkpoint(self.model, self.optimizer, self.scheduler, self.scaler, self.state, self.cfg,
                                   self.class_names, self.shape.checkpoint_fields())

    def chunk_spec(self) -> ChunkSpec:
        """The training chunks now: the config's, or the shorter ones the OOM back-off chose."""
        train_cfg = self.cfg["train"]
        size = train_cfg["chunk_train_size"] if self.state.chunk_train_size is None else self.state.chunk_train_size
        overlap = train_cfg["chunk_train_overlap"]
        if size != -1 and overlap >= size:  # a chunk shortened by the back-off keeps half of itself shared at most
            overlap = size // 2
        return ChunkSpec(size, overlap)

    def save(self, name: str) -> str:
        if not self.runtime.is_main:
            return name
        return self.run.save(self.checkpoint_dict(), name)  # only a run with a checkpoint becomes "latest"



class RunStopped(RuntimeError):
    """A condition that ends the run. Whoever meets it raises and writes nothing; ``engine.loop.saved_on_stop``
    (around fit) saves last.pt once and names it in the message (``note_checkpoint``)."""
    saves_checkpoint = True

    def __init__(self, reason: str, advice: str = ""):
        super().__init__(f"{reason}. {advice}" if advice else reason)
        self.reason, self.advice = reason, advice

    def note_checkpoint(self, path: str) -> None:
        self.args = (f"{self.reason}; saved {path}" + (f". {self.advice}" if self.advice else ""),)


class NonFiniteLossError(RunStopped):
    pass


OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)



def train_batch(trainer: Trainer, group: list[dict], group_size: int, need_update: bool) -> tuple[float, int]:
    """The newest loader batch of an accumulation group through forward and backward (with the OOM back-off);
    at the group's end under DDP, every rank's back-off agreed and the gradients averaged (``agree_and_reduce``),
    so the optimizer step that follows is the same on every rank. Returns (sum of the clip losses, clips)."""
    result = (0.0, 0)
    if trainer.pending_advice is None:  # a rank that could back off no further sits out the rest of its group
        try:
            result = accumulate_with_oom_backoff(trainer, group, group_size)
        except OutOfMemoryAdvice as advice:
            if not trainer.runtime.distributed or isinstance(advice, SyncedOutOfMemory):
                raise
            trainer.pending_advice = advice  # said at the group's end, where every rank learns of it
    if need_update and trainer.runtime.distributed:
        agree_and_reduce(trainer)
    return result


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


def accumulate_with_oom_backoff(trainer: Trainer, group: list[dict], group_size: int):
    """Forward and backward of the newest batch of ``group``; after an out-of-memory error, the micro-batch is
    halved (each loader batch split in two more pieces, so the effective batch stays the same) and the whole
    group is replayed, since its gradients so far were dropped with the failed step."""
    replay = False
    while True:
        failed = False
        try:
            for batch in (group if replay else group[-1:]):
                result = forward_backward(trainer, batch, group_size)
            return result
        except OutOfMemoryError:
            failed = True
        if failed:  # outside the except block: its traceback no longer holds the step's tensors
            if trainer.synced_norm:
                raise SyncedOutOfMemory(
                    f"out of memory with model.norm: sync: every BatchNorm forward is synchronized across the "
                    f"{trainer.runtime.world_size} processes, so one of them cannot retry with a smaller micro-batch "
                    f"alone (the out-of-memory back-off is off with sync, and this process stops the others); "
                    f"resume from the last checkpoint with a smaller data.batch_size (or batch_size: auto), "
                    f"model.grad_checkpointing: true or a shorter train.chunk_train_size, or use model.norm: batch")
            back_off_after_oom(trainer, len(group[-1]["label"]), clip_length(group[-1]))
            replay = True


def forward_backward(trainer: Trainer, batch: dict, group_size: int) -> tuple[float, int]:
    """One loader batch in ``state.micro_splits`` pieces; returns (sum of the clip losses, clips). Under DDP no
    backward all-reduces: ``agree_and_reduce`` averages the gradients once the group is done on every rank."""
    model, runtime = trainer.model, trainer.runtime
    size = len(batch["label"])
    spec = trainer.chunk_spec()
    loss_sum = 0.0
    for piece in micro_batches(trainer, batch):
        inputs = trainer.prepare.transfer(piece)  # frames stay uint8 until their chunk runs
        clips = len(piece["label"])
        with model.no_sync() if runtime.distributed else contextlib.nullcontext():
            with runtime.autocast():
                loss = step_loss(model, inputs, piece, spec, trainer.cfg["train"], trainer.criterion)
            # a piece's mean loss weighted by its share of the batch, over the group: the group's mean loss
            trainer.scaler.scale(loss * (clips / size) / group_size).backward()
        loss_sum += float(loss.detach()) * clips
    return loss_sum, size


def micro_batches(trainer: Trainer, batch: dict) -> list[dict]:
    """A loader batch's model keys in ``state.micro_splits`` non-empty pieces (the OOM back-off's split)."""
    keys = [k for k in MODEL_KEYS if k in batch]
    return [dict(zip(keys, parts)) for parts in zip(*(torch.tensor_split(batch[k], trainer.state.micro_splits)
                                                       for k in keys)) if len(parts[0])]


def training_loss(outputs: torch.Tensor | dict, piece: dict, spec: ChunkSpec, train_cfg: dict,
                  criterion: torch.nn.Module) -> torch.Tensor:
    """train.chunk_loss clip: the aggregated chunk logits (or a temporal head's clip logits) against the clip
    label (the plain loss for one chunk); dense: each chunk (a head's per-chunk logits) against the label
    covering most of its frames, chunks no segment covers left out, averaged over the chunks that count.
    ``outputs``: ChunkedTrainingForward's, chunk logits [n, B, K] or a head's {"clip", "chunks"}."""
    chunk_logits = outputs["chunks"] if isinstance(outputs, dict) else outputs
    device = chunk_logits.device
    if train_cfg["chunk_loss"] == "clip":
        logits = (outputs["clip"] if isinstance(outputs, dict)
                  else aggregate_chunk_logits(chunk_logits, train_cfg["chunk_train_aggregation"]))
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


MODEL_KEYS = ("label", "video", "kpt", "frame_labels")  # what a micro-batch split carries


def step_loss(model, inputs: dict, piece: dict, spec: ChunkSpec, train_cfg: dict,
              criterion: torch.nn.Module) -> torch.Tensor:
    """The forward and loss of one micro-batch, as the training step and the memory planner both run it:
    ``model`` is a ChunkedTrainingForward (DDP-wrapped or not), ``inputs`` the uint8 model inputs on the device,
    ``piece`` the micro-batch's labels."""
    return training_loss(model(inputs, spec), piece, spec, train_cfg, criterion)


def clips_per_forward(trainer: Trainer) -> int:
    return math.ceil(trainer.cfg["data"]["batch_size"] / trainer.state.micro_splits)


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
        data, model = cfg["data"], cfg["model"]
        raise OutOfMemoryAdvice(
            f"out of memory with 1 clip per forward pass in chunks of {_frames(_chunk_frames(trainer, length))} "
            f"(the model's shortest)",
            f"To fit, in this order: "
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


def optimizer_step(trainer: Trainer) -> None:
    optimizer, scaler, state = trainer.optimizer, trainer.scaler, trainer.state
    grad_clip = gradient_clip(trainer.cfg["train"], trainer.has_temporal_head)
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
