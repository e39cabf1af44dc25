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
from core.runtime import unwrap_model
from engine.data import GuardedBatches, make_loader
from engine.step import Trainer, micro_batches
from models.classifier import running_stats_frozen
from models.norms import FrozenBatchNorm

log = logging.getLogger("longvideo")


class LayerMoments:
    """Per-channel count, sum and sum of squares (float64) of the inputs one BatchNorm layer saw."""

    def __init__(self, channels: int, device: torch.device):
        self.sums = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)  # [sum, sum of squares, n]
        self.channels = channels

    def add(self, x: torch.Tensor) -> None:
        dims = [0] + list(range(2, x.dim()))
        count = x.numel() // x.shape[1]
        if not count:
            return
        var, mean = torch.var_mean(x.float(), dim=dims, correction=0)  # centred per call: no cancellation
        mean, var = mean.double(), var.double()
        c = self.channels
        self.sums[:c] += mean * count
        self.sums[c:2 * c] += (var + mean ** 2) * count
        self.sums[-1] += count

    def statistics(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mean, unbiased variance) of everything added; None when fewer than 2 values per channel."""
        c, total = self.channels, float(self.sums[-1])
        if total < 2:
            return None
        mean = self.sums[:c] / total
        variance = (self.sums[c:2 * c] / total - mean ** 2).clamp_min(0) * (total / (total - 1))
        return mean, variance


def recomputable_norms(model: torch.nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers whose running statistics precise BN recomputes (frozen ones keep theirs)."""
    return [m for m in unwrap_model(model).modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats and not isinstance(m, FrozenBatchNorm)]


@torch.no_grad()
def precise_batch_norm(trainer: Trainer, batches, limit: int) -> int:
    """The running statistics of every BatchNorm layer of ``trainer.model`` from the first ``limit`` loader batches
    of ``batches`` (as ``train_one_epoch`` gets them); returns how many were used."""
    model, runtime = trainer.model, trainer.runtime
    norms = recomputable_norms(model)
    moments = {m: LayerMoments(m.num_features, m.running_mean.device) for m in norms}
    hooks = [m.register_forward_pre_hook(lambda module, args: moments[module].add(args[0])) for m in norms]
    forward = model.module if runtime.distributed else model  # DDP's own forward is for training steps
    was_training = model.training
    used = 0
    try:
        model.train()
        with running_stats_frozen(model):  # the forward's own exponential average must not move them
            for batch in batches:
                if used == limit:
                    break
                _forward_in_pieces(trainer, forward, batch)
                used += 1
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    sums = [moments[m].sums for m in norms]
    if runtime.distributed and sums:  # one all-reduce of every layer's moments
        flat = torch.cat(sums)
        torch.distributed.all_reduce(flat)
        sums = torch.split(flat, [s.numel() for s in sums])
    for norm, summed in zip(norms, sums):
        moments[norm].sums = summed
        stats = moments[norm].statistics()
        if stats is not None:
            norm.running_mean.copy_(stats[0])
            norm.running_var.copy_(stats[1])
    return used


def _forward_in_pieces(trainer: Trainer, forward, batch: dict) -> None:
    """One loader batch through the training forward, in the step's micro-batch splits and training chunks."""
    spec = trainer.chunk_spec()
    for piece in micro_batches(trainer, batch):
        inputs = trainer.prepare.transfer(piece)
        with trainer.runtime.autocast():
            forward(inputs, spec)


def precise_bn_before_validation(trainer: Trainer, train_set) -> None:
    """train.precise_bn_batches batches of the training set (the epoch's order, the run's random state left as
    it was) through :func:`precise_batch_norm`, with one line saying so."""
    wanted = trainer.cfg["train"]["precise_bn_batches"]
    if not wanted or not recomputable_norms(trainer.model):
        return
    cfg, runtime = trainer.cfg, trainer.runtime
    loader = make_loader(train_set, cfg, runtime, cfg["data"]["batch_size"], shuffle=True, pad=True)
    loader.sampler.set_epoch(trainer.state.epoch)
    saved = rng_state()
    try:
        used = precise_batch_norm(trainer, GuardedBatches(loader, trainer.report.bad_inputs), wanted)
    finally:
        restore_rng_state(saved)
    note = "" if used == wanted else f" (the training set has only {used} batches)"
    log.info("precise BN: running statistics of %d BatchNorm layers recomputed over %d batches%s",
             len(recomputable_norms(trainer.model)), used, note)
