"""A training run wired from its config: data, model, optimizer, schedule, run directory (or the resumed ones), in
a ``Trainer``."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from artifacts import tensorboard
from artifacts.checkpoint import CheckpointError, TrainState, load_checkpoint, restore_training
from artifacts.csv_log import CsvLog
from artifacts.run_dir import ExperimentDirectory, RunDirectory
from config import Config, TrainConfig, derive, dump
from core import watchdog
from core.errors import ConfigError
from core.files import atomic_write_bytes, remove_stale_temp_files
from core.logs import attach_log_file, detach_log_file
from core.runtime import Runtime, unwrap_model
from datasets.bad_input import BadInputReport
from datasets.device_input import InputPreparer
from datasets.shape import DataShape
from datasets.windows import chunk_windows
from engine.data.feature_files import build_feature_data, feature_loader
from engine.data.loaders import build_data, cap_workers, make_loader
from engine.training.chunked_forward import ChunkedTrainingForward, FeatureHeadForward
from engine.training.feature_bank import FeatureBank
from engine.training.oom import start_memory_history
from engine.training.optim import build_optimizer, build_scheduler, max_grad_norm, warmup_epochs
from engine.training.refit import resume_head_refit
from engine.training.trainer import RunReport, Trainer
from models import ModelConfigError, build_feature_head, build_model, set_head_chunks, temporal_head_of
from models.adapters import parameter_counts
from models.norms import convert_norms

log = logging.getLogger("longvideo")


def build_trainer(
    cfg: Config,
    runtime: Runtime,
    resume_path: str | None = None,
    stop_after_steps: int | None = None,
    kept_chunks: int = 0,
    features_index: tuple | None = None,
) -> tuple[Trainer, DataLoader, DataLoader | None]:
    """Data, model, optimizer, schedule and run directory (or the resumed ones), wired into a Trainer.
    ``cfg`` has a number for data.batch_size (the planner resolves ``auto`` before); ``kept_chunks``: the
    training chunks the planner keeps unrecomputed (train.recompute: auto), unless a resumed checkpoint holds
    its own count (the back-off may have lowered it); ``features_index``: data.features_dir's files as
    ``engine.data.feature_files.index_features`` read them for the planner (read here when not given)."""
    if cfg.train.temporal_refit_epochs and runtime.distributed and cfg.train.ddp_sync == "during_backward":
        raise ConfigError(
            "train.temporal_refit_epochs freezes the backbone during the run, and DistributedDataParallel "
            "(train.ddp_sync: during_backward) keeps the parameters it trains from its start; set train.ddp_sync: "
            "agreed"
        )
    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    seed, source = cfg.train.seed, None
    if cfg.data.features_dir is not None:  # the temporal head alone, over whole videos' features
        train_set, val_set, class_names, source = build_feature_data(cfg, features_index)
        shape = DataShape(len(class_names))
        model, channels_last = _feature_head_on_device(cfg, runtime, source["feature_dim"], len(class_names)), False
        train_loader = feature_loader(train_set, seed, runtime, cfg.data.batch_size, shuffle=True, pad=True)
        val_loader = (
            feature_loader(val_set, seed, runtime, 1, shuffle=False, pad=False) if val_set is not None else None
        )
    else:
        train_set, val_set, class_names, shape = build_data(cfg)
        model, channels_last = _model_on_device(cfg, runtime, shape)
        cfg = cap_workers(cfg)
        train_loader = make_loader(train_set, cfg.data, seed, runtime, cfg.data.batch_size, shuffle=True, pad=True)
        val_loader = (
            make_loader(val_set, cfg.data, seed, runtime, 1, shuffle=False, pad=False)  # clips vary
            if val_set is not None
            else None
        )  # in length
    set_head_chunks(model, cfg.infer.head_chunks)  # validation runs a temporal head as eval.py will
    optimizer = build_optimizer(model, cfg.train)
    if runtime.is_main and temporal_head_of(model) is not None:
        _log_temporal_head_settings(optimizer, cfg.train, cfg.trainer.max_epochs)
    steps_per_epoch = math.ceil(len(train_loader) / cfg.train.accumulate_grad_batches)
    scheduler = build_scheduler(
        optimizer,
        cfg.train,
        steps_per_epoch,
        cfg.trainer.max_epochs,
        has_temporal_head=temporal_head_of(model) is not None,
        refit_epochs=cfg.train.temporal_refit_epochs,
    )
    scaler = runtime.grad_scaler()
    state, pending_rng, run = TrainState(), None, None
    if resume_path:
        state, pending_rng = restore_training(resume_path, model, optimizer, scheduler, scaler, cfg)
        run = RunDirectory.of_checkpoint(resume_path)
        if run is None:  # a checkpoint from elsewhere: nothing is written beside the user's file
            log.info(
                "%s is not inside a run directory of this project (<run>/checkpoints/, with config.yaml): "
                "continuing in a new run directory",
                resume_path,
            )
    if state.kept_chunks is None:
        state.kept_chunks = kept_chunks
    if run is None and runtime.is_main:
        run = RunDirectory.create(ExperimentDirectory.of_config(cfg))
    prepare = InputPreparer(runtime.device, cfg.data.mean, cfg.data.std, channels_last)
    wrapped = wrap_for_training(model, prepare, cfg, runtime)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    trainer = Trainer(
        model=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        prepare=prepare,
        runtime=runtime,
        cfg=cfg,
        run=run,
        class_names=class_names,
        shape=shape,
        criterion=criterion,
        state=state,
        pending_rng=pending_rng,
        stop_after_steps=stop_after_steps,
        report=RunReport(bad_inputs=None if source else BadInputReport(train_set, val_set)),
        features_source=source,
    )
    resume_head_refit(trainer)
    if cfg.train.feature_bank != "off":
        trainer.bank = _feature_bank(trainer, train_set, resume_path)
    if runtime.is_main:
        _start_run_files(trainer, len(train_set))
    start_memory_history(trainer)
    return trainer, train_loader, val_loader


def _feature_bank(trainer: Trainer, train_set, resume_path: str | None) -> FeatureBank:
    """train.feature_bank: the bank over the training set on its chunk grid (restored from the checkpoint's copy
    on resume), each training clip placed in its sample window as evaluation places it (the same frames every
    epoch); its size in one line."""
    cfg, runtime = trainer.cfg, trainer.runtime
    if runtime.distributed:
        raise ConfigError(
            "train.feature_bank runs in one process: under torchrun each rank would see other samples each epoch "
            "and keep a bank of its own; set train.feature_bank: off (train.grad_chunks alone works on every rank)"
        )
    train_set.fixed_clips = True  # before the loader's workers copy the dataset, at the first epoch
    spec = trainer.chunk_spec()
    windows = chunk_windows(cfg.data.num_frames, spec.size, spec.overlap)
    classifier = unwrap_model(trainer.model)
    per_chunk = classifier.feature_dim if temporal_head_of(classifier) is not None else trainer.shape.num_classes
    bank = FeatureBank(len(train_set), windows, cfg.train.feature_bank, trainer.run.feature_bank, per_chunk)
    log.info(
        "train.feature_bank: %s, %s (%d samples x %d chunks x %d float32 values), computing %d chunks a clip a step "
        "and reading the others; a copy beside each checkpoint; each training clip placed as evaluation places it "
        "(centred in its sample window), the same frames every epoch",
        cfg.train.feature_bank,
        f"{bank.nbytes / 2**20:.1f} MB" if bank.nbytes >= 2**20 else f"{bank.nbytes / 1024:.1f} KB",
        bank.samples,
        bank.chunks,
        per_chunk,
        spec.grad_chunks,
    )
    if resume_path:
        bank.restore(resume_path, trainer.state.global_step)
    return bank


def _log_temporal_head_settings(optimizer: torch.optim.Optimizer, train_cfg: TrainConfig, max_epochs: int) -> None:
    """The learning rates a run with a temporal head trains with (the head has its own unless its scale is 1)."""
    rates = {group.get("name", "model"): group["lr"] for group in optimizer.param_groups}
    head_lr = rates.get("temporal head", train_cfg.lr)
    max_norm, warmup = max_grad_norm(train_cfg, True), warmup_epochs(train_cfg, True)
    # the head's own keys reach the whole model: said where they change what the preset alone would do
    clip = "off" if max_norm is None else f"{max_norm:g}"
    if train_cfg.grad_clip is None and max_norm is not None:
        clip += " (train.temporal_grad_clip: the whole model's gradient, the backbone's too; train.grad_clip unset)"
    warm = f"{warmup:g} epochs"
    if warmup > train_cfg.warmup_epochs:
        warm += (
            f" (train.temporal_warmup_epochs, above train.warmup_epochs {train_cfg.warmup_epochs:g}: the whole model)"
        )
    refit = train_cfg.temporal_refit_epochs
    again = (
        f"; from epoch {max_epochs - refit + 1} a new head trains on the backbone, frozen, with the warm-up and the "
        f"schedule again (train.temporal_refit_epochs {refit})"
        if refit
        else ""
    )
    log.info(
        "learning rates: backbone %.2e, temporal head %.2e (train.temporal_lr_scale %g); gradient norm clip %s; "
        "warm-up %s%s",
        rates["model"],
        head_lr,
        train_cfg.temporal_lr_scale,
        clip,
        warm,
        again,
    )


# train.ddp_sync in the run's first lines, under torchrun
DDP_SYNC_WORDS = {
    "during_backward": "the gradients all-reduced during backward (DistributedDataParallel); an out-of-memory error "
    "on one rank stops every rank",
    "agreed": "the gradients averaged after each accumulation group, once every rank agreed on its out-of-memory "
    "back-off",
}


def wrap_for_training(model: torch.nn.Module, prepare: InputPreparer, cfg: Config, runtime: Runtime) -> torch.nn.Module:
    """The training forward (chunks, recomputed) around the classifier (compiled on request). Under torchrun every
    rank starts from rank 0's weights and buffers, and no collective hides in a forward or a backward: a rank that
    backs off after an out-of-memory error runs more forwards than the others. ``engine.training.oom.agree_and_reduce``
    averages the gradients at each accumulation group's end, ``sync_buffers`` the BatchNorm statistics.

    No DistributedDataParallel wrapper then (train.ddp_sync: agreed): with its all-reduce in backward off
    throughout, it did nothing but hold its gradient buckets, a second copy of every gradient (bench/RESULTS.md,
    "Several processes"). With train.ddp_sync:
    during_backward it is there, its all-reduce overlapping backward, the gradients views of its buckets."""
    if cfg.data.features_dir is not None:
        wrapped = FeatureHeadForward(model)
    else:
        wrapped = ChunkedTrainingForward(
            torch.compile(model) if cfg.trainer.compile else model, prepare.normalize, cfg.data.frame_stride
        )
    if runtime.distributed:
        log.info(
            "%d processes, train.ddp_sync: %s: %s",
            runtime.world_size,
            cfg.train.ddp_sync,
            DDP_SYNC_WORDS[cfg.train.ddp_sync],
        )
    with watchdog.armed():  # the weights broadcast: a group that cannot communicate says so within the bound
        if runtime.distributed and cfg.train.ddp_sync == "during_backward":
            return DistributedDataParallel(
                wrapped,
                broadcast_buffers=False,
                gradient_as_bucket_view=True,
                device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
            )
        if runtime.distributed:
            for tensor in [*model.parameters(), *model.buffers()]:  # what DDP does at its construction
                torch.distributed.broadcast(tensor.data, src=0)
    return wrapped


def _feature_head_on_device(cfg: Config, runtime: Runtime, feature_dim: int, num_classes: int) -> torch.nn.Module:
    try:
        model = build_feature_head(cfg.model, feature_dim, num_classes)
    except ModelConfigError as e:
        raise ConfigError(str(e))
    init_temporal_head(model, cfg.model.temporal_head_init)
    return model.to(runtime.device)


def init_temporal_head(model: torch.nn.Module, path: str | None) -> None:
    """model.temporal_head_init: the temporal head's weights from a checkpoint's ``temporal.*`` entries (a head
    trained on features, or an end-to-end run's), so the two-stage path goes on end to end."""
    if path is None:
        return
    try:
        weights = load_checkpoint(path).model
    except CheckpointError as e:
        raise ConfigError(f"model.temporal_head_init: {e}")
    head = {k[len("temporal.") :]: v for k, v in weights.items() if k.startswith("temporal.")}
    if not head:
        raise ConfigError(
            f"model.temporal_head_init: {path} holds no temporal head (its model.temporal_head was "
            f"none); give a checkpoint trained with one"
        )
    try:
        model.temporal.load_state_dict(head)
    except RuntimeError as e:
        raise ConfigError(
            f"model.temporal_head_init: {path}: its temporal head does not fit this one (set "
            f"model.temporal_head, temporal_width, temporal_layers, temporal_input_norm, "
            f"temporal_contrast, temporal_running... as it was trained, and the same classes): {str(e).splitlines()[0]}"
        )
    log.info("model.temporal_head_init: the temporal head starts from %s", path)


def _model_on_device(cfg: Config, runtime: Runtime, shape: DataShape) -> tuple:
    """(the classifier on the device, whether it is in channels_last_3d)."""
    try:
        model = build_model(cfg.model, **shape.model_args())
    except ModelConfigError as e:  # a model section that does not fit the data or the backbone
        raise ConfigError(str(e))
    if cfg.model.temporal_head != "none":
        init_temporal_head(model, cfg.model.temporal_head_init)
    frozen = "model.freeze_backbone" if cfg.model.freeze_backbone else f"model.adapter: {cfg.model.adapter}"
    if (cfg.model.freeze_backbone or cfg.model.adapter != "none") and cfg.model.pretrained is None and runtime.is_main:
        log.warning(
            "%s with model.pretrained null: the backbone stays as it was initialized at random, and only what sits "
            "on it learns; give it weights with model.pretrained",
            frozen,
        )
    if cfg.model.adapter != "none" and runtime.is_main:
        adapted, backbone = parameter_counts(model)
        log.info(
            "model.adapter: %s: %s parameters trained on the frozen backbone's %s (%.2f%%), beside the head's",
            cfg.model.adapter,
            f"{adapted:,}",
            f"{backbone:,}",
            100 * adapted / backbone,
        )
    if cfg.model.norm == "sync":
        _synchronize_norms(model, cfg, runtime)
    model.to(runtime.device)
    channels_last = cfg.trainer.channels_last_3d and runtime.device.type == "cuda"
    if channels_last:
        model = model.to(memory_format=torch.channels_last_3d)
    return model, channels_last


def _synchronize_norms(model: torch.nn.Module, cfg: Config, runtime: Runtime) -> None:
    """model.norm: sync: SyncBatchNorm under torchrun with more than one process, BatchNorm on one. Every
    synchronized forward is a collective, so every rank must run as many training chunks."""
    if not runtime.distributed:
        log.info("model.norm: sync on one process: BatchNorm (statistics of this process's micro-batch)")
        return
    if cfg.data.num_frames == -1 and cfg.train.chunk_train_size != -1:
        raise ConfigError(
            "model.norm: sync synchronizes each training chunk's forward across processes, so every "
            "process must run as many chunks, but data.num_frames: -1 gives clips of any length; set "
            "data.num_frames to a number, train.chunk_train_size: -1, or model.norm: batch"
        )
    count = convert_norms(model, "sync")
    log.info(
        "model.norm: sync: %d BatchNorm layers synchronized over %d processes (the out-of-memory back-off "
        "is off: one process cannot retry a synchronized forward alone)",
        count,
        runtime.world_size,
    )


def _start_run_files(trainer: Trainer, num_samples: int) -> None:
    """train.log, stale temporary files removed, the resolved config.yaml, memory.csv, the run's first line."""
    trainer.report.log_file = attach_log_file(trainer.run.train_log)
    try:
        _write_first_files(trainer, num_samples)
    except BaseException:  # e.g. a full disk: the log file is not left attached to the process's logger
        detach_log_file(trainer.report.log_file)
        raise


def _write_first_files(trainer: Trainer, num_samples: int) -> None:
    run, cfg, runtime = trainer.run, trainer.cfg, trainer.runtime
    removed = remove_stale_temp_files(run.path, recursive=True)
    if removed:
        log.warning(
            "removed %d temporary file(s) left by writers that were killed: %s", len(removed), ", ".join(removed)
        )
    # as run: the precision resolved for this device (the capped workers and a fitted batch are in cfg already)
    as_run = derive(cfg, {"trainer.precision": runtime.precision}, "the precision this device runs")
    atomic_write_bytes(run.config_yaml, dump(as_run).encode())
    if tensorboard.wanted(cfg.trainer.tensorboard):
        resumed_at = trainer.state.global_step or None
        trainer.report.tensorboard = tensorboard.TensorBoardLog(run.tensorboard, purge_step=resumed_at)
        log.info("TensorBoard events: %s (tensorboard --logdir %s)", run.tensorboard, run.path)
    mirror = trainer.report.tensorboard.mirror("memory/", "step") if trainer.report.tensorboard else None
    trainer.report.memory_log = CsvLog(run.memory_csv, mirror)
    global_batch = cfg.data.batch_size * cfg.train.accumulate_grad_batches * runtime.world_size
    log.info(
        "run %s | %s on %s, precision %s | %d training samples, %d classes | global batch %d = %d x %d "
        "accumulated x %d processes",
        run,
        # a head trained on features has no backbone in this run
        f"a {cfg.model.temporal_head} head on features" if cfg.data.features_dir is not None else cfg.model.backbone,
        runtime.device,
        runtime.precision,
        num_samples,
        len(trainer.class_names),
        global_batch,
        cfg.data.batch_size,
        cfg.train.accumulate_grad_batches,
        runtime.world_size,
    )
