"""A training run wired from its config: data, model, optimizer, schedule, run directory (or the resumed ones), in
a ``TrainingRun``."""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from artifacts import tensorboard
from artifacts.checkpoint import TrainState, restore_training
from artifacts.csv_log import CsvLog
from artifacts.run_dir import ExperimentDirectory, RunDirectory
from config import Config, derive, dump
from core import watchdog
from core.errors import ConfigError
from core.files import atomic_write_bytes, remove_stale_temp_files
from core.logs import attach_log_file, detach_log_file
from core.runtime import Runtime, compute_threads, unwrap_model
from datasets.bad_input import BadInputReport
from datasets.device_input import DeviceInputs
from datasets.records import DATA_LAYOUTS
from datasets.shape import DataShape
from datasets.windows import chunk_windows
from engine.data.feature_files import build_feature_data, feature_loader
from engine.data.loaders import build_data, cap_workers, make_loader
from engine.training.chunked_forward import ChunkedTrainingForward, FeatureHeadForward
from engine.training.feature_bank import FeatureBank
from engine.training.motion_pretext import objective_forward
from engine.training.oom import start_memory_history
from engine.training.optim import build_optimizer, build_scheduler, max_grad_norm, warmup_epochs
from engine.training.run import RunReport, TrainingRun
from models import ModelConfigError, build_feature_head, build_model, set_head_chunks, temporal_head_of
from models.adapters import parameter_counts
from models.norms import convert_norms

log = logging.getLogger("longvideo")


def refuse_gpu_preset_without_cuda(cfg: Config, config_path: str | None, device: str | None) -> None:
    """A preset sized for a GPU (trainer.memory_budget_gb, device auto or cuda) on a machine without CUDA would
    train for hours on the CPU without a word: stop at once, unless --device cpu says that is meant."""
    budget, wanted = cfg.trainer.memory_budget_gb, device or cfg.trainer.device
    if budget and wanted != "cpu" and not torch.cuda.is_available():
        raise ConfigError(
            f"{config_path or 'the config'}: this machine has no CUDA device, and the preset is for a "
            f"{budget:g} GB GPU (trainer.memory_budget_gb); use configs/cpu.yaml, or add --device cpu "
            f"to run it on the CPU anyway"
        )


def refuse_demo_data_for_gpu_preset(cfg: Config, origins: dict, config_path: str | None) -> None:
    """A GPU preset names no data of its own: without data.data_dir set (in the user's preset or by --set) it
    would train on the demo's synthetic clips without a word."""
    origin = origins.get("data.data_dir", "defaults")
    if cfg.trainer.memory_budget_gb and (origin == "defaults" or os.path.basename(origin) == "base.yaml"):
        raise ConfigError(
            f"{config_path or 'the config'}: data.data_dir is not set, and a GPU preset does not fall back to the "
            f"demo's {cfg.data.data_dir}: add --set data.data_dir=DIR (the folder of your manifests: "
            f"data.train_manifest, data.val_manifest or data.val_fraction), or set it in a preset of your own; a "
            f"manifest may be {DATA_LAYOUTS}"
        )


def build_run(
    cfg: Config,
    runtime: Runtime,
    resume_path: str | None = None,
    stop_after_steps: int | None = None,
    kept_chunks: int = 0,
    features_index: tuple | None = None,
) -> tuple[TrainingRun, DataLoader, DataLoader | None]:
    """Data, model, optimizer, schedule and run directory (or the resumed ones), wired into a TrainingRun.
    ``cfg`` has a number for data.batch_size (the planner resolves ``auto`` before); ``kept_chunks``: the
    training chunks the planner keeps unrecomputed, unless a resumed checkpoint holds its own count (the back-off
    may have lowered it); ``features_index``: data.features_dir's files as
    ``engine.data.feature_files.index_features`` read them for the planner (read here when not given)."""
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
            make_loader(val_set, cfg.data, seed, runtime, 1, shuffle=False, pad=False)  # clips vary in length
            if val_set is not None
            else None
        )
    set_head_chunks(model, cfg.infer.head_chunks)  # validation runs a temporal head as eval.py will
    optimizer = build_optimizer(model, cfg.train)
    has_head = temporal_head_of(model) is not None
    if runtime.is_main and has_head:
        clip = max_grad_norm(cfg.train, True)
        log.info(
            "temporal head: a warm-up of %g epochs and the gradient norm clipped at %s, for the whole model "
            "(train.temporal_warmup_epochs, train.temporal_grad_clip)",
            warmup_epochs(cfg.train, True),
            "no value" if clip is None else f"{clip:g}",
        )
    steps_per_epoch = math.ceil(len(train_loader) / cfg.train.accumulate_grad_batches)
    scheduler = build_scheduler(optimizer, cfg.train, steps_per_epoch, has_temporal_head=has_head)
    scaler = runtime.grad_scaler()
    state, pending_rng, directory = TrainState(), None, None
    if resume_path:
        state, pending_rng = restore_training(resume_path, model, optimizer, scheduler, scaler, cfg)
        directory = RunDirectory.of_checkpoint(resume_path)
        if directory is None:  # a checkpoint from elsewhere: nothing is written beside the user's file
            log.info(
                "%s is not inside a run directory of this project (<run>/checkpoints/, with config.yaml): "
                "continuing in a new run directory",
                resume_path,
            )
    if state.kept_chunks is None:
        state.kept_chunks = kept_chunks
    if directory is None and runtime.is_main:
        directory = RunDirectory.create(ExperimentDirectory.of_config(cfg))
    device_inputs = DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std, channels_last)
    run = TrainingRun(
        model=wrap_for_training(model, device_inputs, cfg, runtime),
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        inputs=device_inputs,
        runtime=runtime,
        cfg=cfg,
        directory=directory,
        class_names=class_names,
        shape=shape,
        criterion=torch.nn.CrossEntropyLoss(),
        state=state,
        pending_rng=pending_rng,
        stop_after_steps=stop_after_steps,
        report=RunReport(bad_inputs=None if source else BadInputReport(train_set, val_set)),
        features_source=source,
    )
    if cfg.train.feature_bank != "off":
        run.bank = _feature_bank(run, train_set, resume_path)
        run.model.bank = run.bank  # the training forward's (the bank runs in one process: no DDP wrapper)
    if runtime.is_main:
        _start_run_files(run, len(train_set))
    start_memory_history(run)
    return run, train_loader, val_loader


def _feature_bank(run: TrainingRun, train_set, resume_path: str | None) -> FeatureBank:
    """train.feature_bank: the bank over the training set on its chunk grid (restored from the checkpoint's copy
    on resume), each training clip placed in its sample window as evaluation places it (the same frames every
    epoch); its size in one line."""
    cfg, runtime = run.cfg, run.runtime
    if runtime.distributed:
        raise ConfigError(
            "train.feature_bank runs in one process: under torchrun each rank would see other samples each epoch "
            "and keep a bank of its own; set train.feature_bank: off (train.grad_chunks alone works on every rank)"
        )
    train_set.fixed_clips = True  # before the loader's workers copy the dataset, at the first epoch
    spec = run.chunk_spec()
    chunks = chunk_windows(cfg.data.num_frames, spec.size, spec.overlap)
    classifier = unwrap_model(run.model)
    per_chunk = classifier.feature_dim if temporal_head_of(classifier) is not None else run.shape.num_classes
    bank = FeatureBank(len(train_set), chunks, cfg.train.feature_bank, run.directory.feature_bank, per_chunk)
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
        bank.restore(resume_path, run.state.global_step)
    return bank


# train.ddp_sync in the run's first lines, under torchrun
DDP_SYNC_WORDS = {
    "during_backward": "the gradients all-reduced during backward (DistributedDataParallel); an out-of-memory error "
    "on one rank stops every rank",
    "agreed": "the gradients averaged after each accumulation group, once every rank agreed on its out-of-memory "
    "back-off",
}


def wrap_for_training(
    model: torch.nn.Module, device_inputs: DeviceInputs, cfg: Config, runtime: Runtime
) -> torch.nn.Module:
    """The training forward (chunks, recomputed) around the classifier (compiled on request). Under torchrun every
    rank starts from rank 0's weights and buffers, and no collective hides in a forward or a backward: a rank that
    backs off after an out-of-memory error runs more forwards than the others. ``engine.training.oom.agree_and_reduce``
    averages the gradients at each accumulation group's end, train.py's ``sync_buffers`` the BatchNorm statistics.

    No DistributedDataParallel wrapper then (train.ddp_sync: agreed): with its all-reduce in backward off
    throughout, it would do nothing but hold its gradient buckets, a second copy of every gradient. With
    train.ddp_sync: during_backward it is there, its all-reduce overlapping backward, the gradients views of its
    buckets."""
    if cfg.data.features_dir is not None:
        wrapped = FeatureHeadForward(model)
    else:
        chunked = ChunkedTrainingForward(
            torch.compile(model) if cfg.trainer.compile else model, device_inputs.normalize, cfg.data.frame_stride
        )
        wrapped = objective_forward(chunked, cfg.train.objective)
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
    return model.to(runtime.device)


def _model_on_device(cfg: Config, runtime: Runtime, shape: DataShape) -> tuple:
    """(the classifier on the device, whether it is in channels_last_3d)."""
    try:
        model = build_model(cfg.model, **shape.model_args())
    except ModelConfigError as e:  # a model section that does not fit the data or the backbone
        raise ConfigError(str(e))
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


def _start_run_files(run: TrainingRun, num_samples: int) -> None:
    """train.log, stale temporary files removed, the resolved config.yaml, memory.csv, the run's first line."""
    run.report.log_file = attach_log_file(run.directory.train_log)
    try:
        _write_first_files(run, num_samples)
    except BaseException:  # e.g. a full disk: the log file is not left attached to the process's logger
        detach_log_file(run.report.log_file)
        raise


def _write_first_files(run: TrainingRun, num_samples: int) -> None:
    directory, cfg, runtime = run.directory, run.cfg, run.runtime
    removed = remove_stale_temp_files(directory.path, recursive=True)
    if removed:
        log.warning(
            "removed %d temporary file(s) left by writers that were killed: %s", len(removed), ", ".join(removed)
        )
    # as run: the precision resolved for this device (the capped workers and a fitted batch are in cfg already)
    as_run = derive(cfg, {"trainer.precision": runtime.precision}, "the precision this device runs")
    atomic_write_bytes(directory.config_yaml, dump(as_run).encode())
    if tensorboard.wanted(cfg.trainer.tensorboard):
        resumed_at = run.state.global_step or None
        run.report.tensorboard = tensorboard.TensorBoardLog(directory.tensorboard, purge_step=resumed_at)
        log.info("TensorBoard events: %s (tensorboard --logdir %s)", directory.tensorboard, directory.path)
    mirror = run.report.tensorboard.mirror("memory/", "step") if run.report.tensorboard else None
    run.report.memory_log = CsvLog(directory.memory_csv, mirror)
    global_batch = cfg.data.batch_size * cfg.train.accumulate_grad_batches * runtime.world_size
    device = f"cpu ({compute_threads()})" if runtime.device.type == "cpu" else runtime.device
    log.info(
        "run %s | %s on %s, precision %s | %d training samples, %d classes | global batch %d = %d x %d "
        "accumulated x %d processes",
        directory,
        # a head trained on features has no backbone in this run
        f"a {cfg.model.temporal_head} head on features" if cfg.data.features_dir is not None else cfg.model.backbone,
        device,
        runtime.precision,
        num_samples,
        len(run.class_names),
        global_batch,
        cfg.data.batch_size,
        cfg.train.accumulate_grad_batches,
        runtime.world_size,
    )
