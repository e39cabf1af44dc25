"""Precise BN (train.precise_bn_batches): before a validation, the BatchNorm running statistics recomputed as the
true mean and variance of each layer's input over N training batches, instead of the exponential average of
small, noisy micro-batch (or chunk) statistics (SlowFast's precise BN; Wu & Johnson, "Rethinking 'Batch' in
BatchNorm", 2021).

The batches go through the training forward as a step runs them (the same micro-batch splits and training
chunks, each layer normalizing with its batch statistics as in training), under ``no_grad``. Each BatchNorm
layer's input is summarized per call (count, mean, variance) and pooled exactly: the running mean becomes the
mean of all its inputs' elements, the running variance their variance (unbiased, as BatchNorm stores it), which
counts the spread between batches too, as the fixed statistics of evaluation meet it. Under DDP the moments of
every rank are summed, so all ranks hold the same statistics. Nothing else changes: not the weights, not
``num_batches_tracked``, not the run's random state (the pass runs on a copy of it), so resume stays exact.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from artifacts.checkpoint import restore_rng_state, rng_state
from core import watchdog
from core.runtime import unwrap_model
from engine.data.loaders import GuardedBatches, make_loader
from engine.training.run import TrainingRun
from engine.training.step import micro_batches
from models.classifier import running_stats_frozen
from models.norms import FrozenBatchNorm, batch_norms, channel_moments, pooled_statistics

log = logging.getLogger("longvideo")


def recomputable_norms(model: torch.nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers whose running statistics precise BN recomputes: frozen ones keep theirs, and so do those
    of a frozen backbone (model.freeze_backbone, model.adapter), which stay in eval."""
    classifier = unwrap_model(model)
    fixed = set(batch_norms(classifier.rgb)) if getattr(classifier, "frozen_backbone", False) else set()
    return [
        m
        for m in batch_norms(classifier)
        if m.track_running_stats and not isinstance(m, FrozenBatchNorm) and m not in fixed
    ]


@torch.no_grad()
def precise_batch_norm(run: TrainingRun, batches, limit: int) -> int:
    """The running statistics of every BatchNorm layer of ``run.model`` from the first ``limit`` loader batches
    of ``batches`` (as ``train_one_epoch`` gets them); returns how many were used."""
    model, runtime = run.model, run.runtime
    norms = recomputable_norms(model)
    moments = {m: torch.zeros(2 * m.num_features + 1, dtype=torch.float64, device=m.running_mean.device) for m in norms}

    def record(module, args) -> None:  # a pre-hook that returned a value would replace the layer's input
        moments[module].add_(channel_moments(args[0]))

    hooks = [m.register_forward_pre_hook(record) for m in norms]
    forward = getattr(model, "module", model) if run.syncs_in_backward else model  # DDP's forward is the step's
    was_training = model.training
    used = 0
    try:
        model.train()
        with running_stats_frozen(model):  # the forward's own exponential average must not move them
            for batch in batches:
                if used == limit:
                    break
                _forward_in_pieces(run, forward, batch)
                watchdog.beat()
                used += 1
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    sums = [moments[m] for m in norms]
    if runtime.distributed and sums:  # one all-reduce of every layer's moments
        flat = torch.cat(sums)
        torch.distributed.all_reduce(flat)
        sums = torch.split(flat, [s.numel() for s in sums])
    for norm, summed in zip(norms, sums):
        mean, variance, total = pooled_statistics(summed)
        if total >= 2:  # unbiased, as BatchNorm stores it
            norm.running_mean.copy_(mean)
            norm.running_var.copy_(variance * (total / (total - 1)))
    return used


def _forward_in_pieces(run: TrainingRun, forward, batch: dict) -> None:
    """One loader batch through the training forward, in the step's micro-batch splits and training chunks."""
    spec = run.chunk_spec()
    for piece in micro_batches(batch, run.state.micro_splits):
        inputs = run.inputs.transfer(piece)
        with run.runtime.autocast():
            forward(inputs, spec)


def precise_bn_before_validation(run: TrainingRun, train_set) -> None:
    """train.precise_bn_batches batches of the training set (the epoch's order, the run's random state left as
    it was) through :func:`precise_batch_norm`, with one line saying so."""
    wanted = run.cfg.train.precise_bn_batches
    layers = len(recomputable_norms(run.model)) if wanted else 0
    if not layers:
        return
    cfg, runtime = run.cfg, run.runtime
    loader = make_loader(train_set, cfg.data, cfg.train.seed, runtime, cfg.data.batch_size, shuffle=True, pad=True)
    loader.sampler.set_epoch(run.state.epoch)
    saved = rng_state()
    try:
        used = precise_batch_norm(run, GuardedBatches(loader, run.report.bad_inputs), wanted)
    finally:
        restore_rng_state(saved)
    note = "" if used == wanted else f" (the training set has only {used} batches)"
    log.info("precise BN: running statistics of %d BatchNorm layers recomputed over %d batches%s", layers, used, note)
