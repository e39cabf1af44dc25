"""The training sampler: a permutation (or a weighted draw, data.balance) fixed by (seed, epoch), sharded by rank,
that can start mid-epoch."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler

EPOCH_SEED_STRIDE = 100003  # a prime above any epoch count: (seed, epoch) pairs never share a permutation


class EpochSampler(Sampler):
    """A permutation fixed by (seed, epoch), sharded by rank, that can start mid-epoch (exact resume)."""

    def __init__(
        self,
        size: int,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        pad: bool = True,
        weights: torch.Tensor | None = None,
    ):
        """pad: repeat samples so every rank gets as many (training, where DDP needs equal step counts);
        validation shards are not padded, so no sample counts twice. ``weights`` (data.balance): each epoch
        draws ``size`` samples with replacement in proportion to them, instead of a permutation."""
        self.size, self.shuffle, self.seed, self.pad, self.weights = size, shuffle, seed, pad, weights
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * EPOCH_SEED_STRIDE + self.epoch)
        if self.weights is not None:
            order = torch.multinomial(self.weights, self.size, replacement=True, generator=generator)
        elif self.shuffle:
            order = torch.randperm(self.size, generator=generator)
        else:
            order = torch.arange(self.size)
        if self.pad:
            per_rank = math.ceil(self.size / self.world_size)
            order = torch.cat([order, order[: per_rank * self.world_size - self.size]])  # equal shards
        return order[self.rank :: self.world_size].tolist()

    def __iter__(self):
        return iter(self._indices()[self.start :])

    def __len__(self) -> int:
        per_rank = (
            math.ceil(self.size / self.world_size) if self.pad else len(range(self.rank, self.size, self.world_size))
        )
        return max(per_rank - self.start, 0)  # 0: a run stopped after the epoch's last batch, before its end
