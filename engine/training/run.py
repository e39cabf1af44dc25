"""``TrainingRun``: what every training step needs, built once by ``build.build_run``; and the conditions that end a
run (``RunStopped``)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch

from artifacts.checkpoint import Checkpoint, TrainState
from artifacts.csv_log import CsvLog
from artifacts.run_dir import RunDirectory
from artifacts.tensorboard import TensorBoardLog
from config import Config
from core.runtime import Runtime, unwrap_model
from datasets.bad_input import BadInputReport
from datasets.device_input import DeviceInputs
from datasets.shape import DataShape
from engine.training.chunked_forward import ChunkSpec, grad_chunks_of, seed_of
from engine.training.feature_bank import FeatureBank
from engine.training.motion_pretext import objective_losses
from engine.training.optim import max_grad_norm
from models import temporal_head_of

log = logging.getLogger("longvideo")


@dataclass
class RunReport:
    """What a run tells besides its checkpoints and metrics: the log file, memory.csv, the skipped files, the clock."""

    log_file: logging.Handler | None = None  # <run>/train.log: what the console shows, with timestamps
    memory_log: CsvLog | None = None  # memory.csv
    bad_inputs: BadInputReport | None = None  # skipped files and data warnings, reported once per run
    started: float = field(default_factory=time.time)
    last_progress: float = field(default_factory=time.time)  # the last progress line's time
    at_chance_said: bool = False  # the warning of a validation at chance, once a run
    memory_history: bool = False  # CUDA's allocator records its history (trainer.memory_snapshot: on_oom)
    tensorboard: TensorBoardLog | None = None  # trainer.tensorboard: metrics.csv's and memory.csv's scalars there

    def take_bad_inputs(self, batch: dict) -> None:
        """The files a loader batch skipped (data.on_bad_video: skip), recorded to be said once."""
        if self.bad_inputs is not None:
            self.bad_inputs.take(batch)

    def end_epoch(self, epoch: int) -> None:
        if self.bad_inputs is not None:
            self.bad_inputs.end_epoch(epoch)

    def end_run(self) -> None:
        if self.bad_inputs is not None:
            self.bad_inputs.end_run()

    def write_memory(self, epoch: int, step: int, snapshot: dict) -> None:
        """A row of memory.csv (rank 0's)."""
        if self.memory_log is not None:
            self.memory_log.write({"epoch": epoch, "step": step, **snapshot})

    def metrics_log(self, directory: RunDirectory, history: list) -> CsvLog:
        """metrics.csv, its rows made those of ``history`` (the epochs of the checkpoint resumed from)."""
        mirror = self.tensorboard.mirror("", "epoch") if self.tensorboard else None
        metrics = CsvLog(directory.metrics_csv, mirror)
        changed = metrics.keep_rows_of(history)
        if changed:  # e.g. a run stopped by a full disk between its checkpoint and its row
            log.warning(
                "%s: %d row(s) written or removed to match the %d epochs of the checkpoint resumed from",
                directory.metrics_csv,
                changed,
                len(history),
            )
        return metrics


@dataclass
class TrainingRun:
    """What every step of train.py's loop needs, built once in its main()."""

    model: torch.nn.Module  # a ChunkedTrainingForward around the classifier
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    inputs: DeviceInputs  # batches to the device, frames normalized there
    runtime: Runtime
    cfg: Config
    directory: RunDirectory | None  # None on ranks other than 0: only rank 0 writes
    class_names: list
    shape: DataShape
    criterion: torch.nn.Module
    state: TrainState
    pending_rng: dict | None = None
    pending_advice: Exception | None = None  # DDP: this rank could back off no further; raised at the group's end
    stop_after_steps: int | None = None
    report: RunReport = field(default_factory=RunReport)
    # training on features: the backbone checkpoint (path, sha256) and chunking they came from; in every checkpoint,
    # so eval.py and infer_chunked.py pair the head with that backbone
    features_source: dict | None = None
    bank: FeatureBank | None = None  # train.feature_bank: the training samples' chunk outputs between epochs

    @property
    def has_temporal_head(self) -> bool:
        return temporal_head_of(self.model) is not None

    @property
    def has_auxiliary_loss(self) -> bool:
        """model.chunk_reconstruction's decoder is in the model: the training loss is the label's and its."""
        return getattr(unwrap_model(self.model), "reconstruction", None) is not None

    @property
    def max_grad_norm(self) -> float | None:
        return max_grad_norm(self.cfg.train, self.has_temporal_head)

    @cached_property
    def losses(self) -> Callable:
        """``(the training forward's outputs, piece, spec) -> (the label's loss, the auxiliary loss or None)``;
        train.objective: motion's loss without labels. Chosen once: the config and the criterion do not change."""
        return objective_losses(self.cfg.train, self.criterion)

    def sync_context(self, syncs: bool):
        """DDP's all-reduce in this backward where it is the accumulation group's last (``syncs``, with
        train.ddp_sync: during_backward), none in the others."""
        return self.model.no_sync() if self.syncs_in_backward and not syncs else contextlib.nullcontext()

    @property
    def syncs_in_backward(self) -> bool:
        """train.ddp_sync: during_backward under torchrun: DDP all-reduces during backward (no OOM back-off then)."""
        return self.runtime.distributed and self.cfg.train.ddp_sync == "during_backward"

    @property
    def synced_norm(self) -> bool:
        """SyncBatchNorm under DDP: a collective in every forward (no OOM back-off then)."""
        return self.runtime.distributed and self.cfg.model.norm == "sync"

    def checkpoint(self) -> Checkpoint:
        ckpt = Checkpoint.of_training(
            self.model, self.optimizer, self.scheduler, self.scaler, self.state, self.cfg, self.class_names, self.shape
        )
        ckpt.features_source = self.features_source
        return ckpt

    def chunk_spec(self, batch_in_group: int = 0, piece: int = 0) -> ChunkSpec:
        """The training chunks now: the config's, or the shorter ones the OOM back-off chose; the chunks kept
        unrecomputed as the planner decided and the back-off lowered; with
        train.grad_chunks, the draw of the chunks with a gradient for this step, the loader batch's place in its
        accumulation group and the micro-batch's (the same draw when a resumed run replays it)."""
        train_cfg = self.cfg.train
        size = train_cfg.chunk_train_size if self.state.chunk_train_size is None else self.state.chunk_train_size
        overlap = train_cfg.chunk_train_overlap
        if size != -1 and overlap >= size:  # a chunk shortened by the back-off keeps half of itself shared at most
            overlap = size // 2
        kept = self.state.kept_chunks or 0
        # not the rank: every rank draws the same chunks, as one process draws them for its whole batch, so the
        # step does not depend on how the global batch is spread over processes
        draw = seed_of(train_cfg.seed, self.state.global_step, batch_in_group, piece)
        return ChunkSpec(size, overlap, kept=kept, grad_chunks=grad_chunks_of(train_cfg.grad_chunks), draw=draw)

    def save(self, name: str) -> str:
        if not self.runtime.is_main:
            return name
        path = self.directory.save(self.checkpoint(), name)  # only a run with a checkpoint becomes "latest"
        if self.bank is not None:
            self.bank.save(path, self.state.global_step)
        return path


class RunStopped(RuntimeError):
    """A condition that ends the run. Whoever meets it raises and writes nothing; ``engine.training.interrupt.
    saved_on_stop`` (around train.py's fit) saves last.pt once and names it in the message (``note_checkpoint``)."""

    saves_checkpoint = True

    def __init__(self, reason: str, advice: str = ""):
        self.reason, self.advice = reason, advice
        super().__init__(self._text())

    def _text(self, saved: str | None = None) -> str:
        return self.reason + (f"; saved {saved}" if saved else "") + (f". {self.advice}" if self.advice else "")

    def note_checkpoint(self, path: str) -> None:
        self.args = (self._text(path),)


class NonFiniteLossError(RunStopped):
    pass
