"""train.feature_bank: each training sample's chunk outputs kept between epochs (TALLFormer's memory bank), so a
step computes only the chunks drawn for the gradient (train.grad_chunks) and reads the others.

The bank holds, for every sample of the training set and every chunk of its clip, what the chunk's forward gives
the step: its features with a temporal head, its logits without one ([samples, chunks, ...] float32, NaN where
nothing was computed yet). A chunk read from the bank was computed at an earlier step, by the weights of then: the
staleness TALLFormer accepts for its long-term memory. A chunk the bank lacks for some sample of the batch (the
first epoch) runs forward without a graph and is written. Every drawn chunk refreshes its rows.

It needs a fixed chunk grid: every epoch a sample must give the same frames (no augmentation, which the config
refuses; each training clip placed as evaluation places it, centred in its sample window, instead of at random),
cut into the same chunks (a chunk size changed by the out-of-memory back-off empties it, with a line).

``host`` keeps it in memory; ``disk`` memory-maps ``feature_bank.npy`` in the run directory for sets larger than
memory. The bank is part of the run's state: each checkpoint has its copy beside it (``<checkpoint
stem>.bank.npz``, written atomically, with its step), which resume restores; without one, the bank starts empty
and the log says this resume is not bit-exact.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from artifacts.run_dir import CHECKPOINT_SIDECARS, sidecar
from core.files import atomic_open

log = logging.getLogger("longvideo")


def bank_file(checkpoint: str) -> str:
    """The bank's copy beside a checkpoint: checkpoints/last.pt -> checkpoints/last.bank.npz."""
    return sidecar(checkpoint, CHECKPOINT_SIDECARS[0])


class FeatureBank:
    """The chunk outputs of ``samples`` training samples on the chunk grid ``windows``; ``storage`` host or disk
    (``live_file``: disk's memory-mapped file, the run directory's). The array is made at the first write, when the
    shape of a chunk's output is known."""

    def __init__(
        self,
        samples: int,
        windows: list[tuple[int, int]],
        storage: str,
        live_file: str | None = None,
        per_chunk: int = 0,
    ):
        if storage not in ("host", "disk") or (storage == "disk" and not live_file):
            raise ValueError(f"feature bank storage {storage!r} (disk needs its file)")
        self.samples, self.windows, self.storage, self.live_file = samples, list(windows), storage, live_file
        self.per_chunk = per_chunk  # float32 values a chunk's output has, for the size stated before the run
        self.values: np.ndarray | None = None
        self.reads = self.writes = 0  # chunk rows of whole batches read and written (the tests count them)

    @property
    def chunks(self) -> int:
        return len(self.windows)

    def _allocate(self, shape: tuple[int, ...]) -> None:
        full = (self.samples, self.chunks, *shape)
        if self.storage == "disk":
            self.values = np.lib.format.open_memmap(self.live_file, mode="w+", dtype=np.float32, shape=full)
            self.values[...] = np.nan
        else:
            self.values = np.full(full, np.nan, dtype=np.float32)

    def follows(self, windows: list[tuple[int, int]]) -> bool:
        return list(windows) == self.windows

    def regrid(self, windows: list[tuple[int, int]], why: str) -> None:
        """A new chunk grid (the out-of-memory back-off shortened the chunks): the bank starts empty on it."""
        log.warning(
            "train.feature_bank: %s: the chunk grid changed (%d chunks a clip, was %d), so the bank starts empty",
            why,
            len(windows),
            self.chunks,
        )
        self.windows, self.values = list(windows), None

    def read(self, samples: torch.Tensor, chunk: int) -> torch.Tensor | None:
        """Chunk ``chunk`` of each of ``samples`` ([B] indices), or None unless every one of them is in the bank."""
        if self.values is None:
            return None
        rows = np.asarray(self.values[samples.numpy(), chunk])
        if np.isnan(rows).any():
            return None
        self.reads += 1
        return torch.from_numpy(rows)

    def write(self, samples: torch.Tensor, chunk: int, outputs: torch.Tensor) -> None:
        rows = outputs.detach().float().cpu().numpy()
        if self.values is None:
            self._allocate(rows.shape[1:])
        self.values[samples.numpy(), chunk] = rows
        self.writes += 1

    # ------------------------------------------------------------------------------------------ the run's state
    def save(self, checkpoint: str, step: int) -> None:
        """The bank as it is now beside ``checkpoint`` (temp, fsync, rename), with the step it belongs to (the
        checkpoint's ``global_step``: a crash between the two files is found at resume); an empty bank writes
        nothing."""
        if self.values is None:
            return
        with atomic_open(bank_file(checkpoint)) as f:
            np.savez(f, values=self.values, step=np.int64(step))

    def restore(self, checkpoint: str, step: int) -> None:
        """The bank saved beside ``checkpoint`` at ``step``; without one (deleted, another machine, a crash between
        the checkpoint and its bank, a grid or set of another shape), an empty bank and one line: this resume is
        not bit-exact."""
        path = bank_file(checkpoint)
        if not os.path.exists(path):
            return self._not_restored(checkpoint, f"{os.path.basename(path)} is missing")
        with np.load(path) as saved:
            if int(saved["step"]) != step:
                return self._not_restored(checkpoint, f"its bank is of step {int(saved['step'])}, not {step}")
            values = saved["values"]
        if values.shape[:2] != (self.samples, self.chunks):
            return self._not_restored(
                checkpoint, f"its bank holds {values.shape[0]} samples x {values.shape[1]} chunks, this run "
                f"{self.samples} x {self.chunks}"
            )  # fmt: skip
        self._allocate(values.shape[2:])
        self.values[...] = values

    @staticmethod
    def _not_restored(checkpoint: str, why: str) -> None:
        log.warning(
            "train.feature_bank: no bank to resume with beside %s (%s): the bank is rebuilt as the steps go, so "
            "this resume is not bit-exact",
            checkpoint,
            why,
        )

    @property
    def nbytes(self) -> int:
        """Its size when full (stated before the run, in the log and the disk plan)."""
        return self.samples * self.chunks * self.per_chunk * 4
