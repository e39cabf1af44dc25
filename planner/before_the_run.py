"""The planner's decisions before a training run is built (``memory_decisions``) and the disk it states once the
run exists (``state_disk_needs``): what train.py asks the planner, in the order it asks."""

from __future__ import annotations

import math
from typing import NamedTuple

from config import Config
from core.runtime import Runtime, unwrap_model
from datasets.shape import DataShape
from engine.data.feature_files import index_feature_data
from planner.batch_size import batch_for_budget, chunks_to_keep
from planner.disk import DiskPlan, bytes_written, disk_plan, state_disk_plan
from planner.features import plan_feature_training
from planner.host import warn_if_host_memory_short
from planner.project import LoopStep


class MemoryDecisions(NamedTuple):
    cfg: Config  # with its batch fitted to the budget (data.batch_size: auto or --fit-budget)
    kept_chunks: int  # training chunks whose activations are kept
    features_index: dict | None  # a head trained on features: every features file's header, read once


def memory_decisions(cfg: Config, runtime: Runtime, fit_budget: bool, step: LoopStep) -> MemoryDecisions:
    """The batch fitted to the budget, the training chunks kept, a features run's index; ``step``: train.py's."""
    shape = DataShape.of_manifest(cfg)  # read once (manifest, keypoints) for both decisions below
    if cfg.data.features_dir is not None:  # a temporal head on features: no clips, no chunks to recompute
        features_index = index_feature_data(cfg.data)  # every file's header, read once for both
        cfg = plan_feature_training(cfg, runtime, shape.num_classes, features_index, step)
        return MemoryDecisions(cfg, 0, features_index)
    if fit_budget or cfg.data.batch_size == "auto":  # the same decision again on resume: deterministic
        cfg = batch_for_budget(cfg, runtime, shape, step)
    kept_chunks = chunks_to_keep(cfg, runtime, shape, step)  # at the run's batch
    if runtime.is_main:
        warn_if_host_memory_short(cfg, shape, runtime.device.type == "cuda")
    return MemoryDecisions(cfg, kept_chunks, None)


def state_disk_needs(run, loader_batches: int, resumed: bool) -> DiskPlan:
    """The disk the run needs, stated (and a warning if the free space is short) before the first step."""
    cfg = run.cfg
    steps_per_epoch = math.ceil(loader_batches / cfg.train.accumulate_grad_batches)
    bank = run.bank.nbytes if run.bank is not None else 0
    plan = disk_plan(cfg, unwrap_model(run.model), steps_per_epoch, bank)
    state_disk_plan(plan, cfg.trainer.output_dir, written=bytes_written(run.directory.path) if resumed else 0)
    return plan
