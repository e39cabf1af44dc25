"""The data of a run: datasets from the config's manifests, and their DataLoaders."""

from __future__ import annotations

import logging
import weakref
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset

from artifacts.checkpoint import restore_rng_state
from config import Config, DataConfig, apply_flags
from core import watchdog
from core.errors import ConfigError
from core.files import process_temp_dir, remove_own_temp_dir
from core.runtime import Runtime, available_cores
from datasets.bad_input import BadInputReport
from datasets.records import resolve_class_names, training_records
from datasets.sampler import EpochSampler
from datasets.shape import DataShape
from datasets.video.info import StalledFile
from datasets.video_dataset import build_dataset, collate_samples, index_cache_for
from datasets.workers import before_workers_fork, take_stall_report, worker_init

log = logging.getLogger("longvideo")
STALL_FOLDER_PREFIX = "longvideo-stalls-"  # + the pid of the run that made it (removed when it ends)
PREFETCH_FACTOR = 2  # batches each worker loads ahead: the host holds num_workers x this many (planner/host.py)


def make_loader(
    dataset, data: DataConfig, seed: int, runtime: Runtime, batch_size: int, shuffle: bool, pad: bool
) -> DataLoader:
    """shuffle: a new permutation every epoch (training; with data.balance, a weighted draw); pad: equal shards for
    every rank (training, where DDP needs equal step counts; evaluation shards are not padded, so no sample counts
    twice). Iterate it through ``GuardedBatches`` (the sample deadline)."""
    if data.sample_timeout_s is not None and dataset.stall_folder is None:
        dataset.stall_folder = process_temp_dir(STALL_FOLDER_PREFIX)  # workers' reports (StallWatch)
        weakref.finalize(dataset, remove_own_temp_dir, dataset.stall_folder)  # or at exit
    weights = dataset.balance_weights(data.balance) if shuffle and data.balance != "none" else None
    sampler = EpochSampler(
        len(dataset),
        shuffle=shuffle,
        seed=seed,
        rank=runtime.rank,
        world_size=runtime.world_size,
        pad=pad,
        weights=weights,
    )
    before_workers_fork(data.num_workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=data.num_workers,
        worker_init_fn=worker_init,
        collate_fn=collate_samples,
        prefetch_factor=PREFETCH_FACTOR if data.num_workers > 0 else None,
        pin_memory=runtime.device.type == "cuda",  # page-locked batches: their copy to the GPU does not wait
        drop_last=False,
        persistent_workers=False,
    )


def cap_workers(cfg: Config) -> Config:
    """No more DataLoader workers than cores (a preset for a 16-core workstation on a 2-core laptop): one line,
    instead of PyTorch's warning once per loader; and at least one with data.sample_timeout_s (a sample blocked
    in the decoder can only be stopped with its process, never in the main one). A new config (the validated one
    is not changed), so the run's config.yaml records what ran."""
    cores, wanted = available_cores(), cfg.data.num_workers
    if wanted == 0 and cfg.data.sample_timeout_s is not None:
        log.info(
            "data.num_workers=0 with data.sample_timeout_s: samples load in 1 DataLoader worker, a process "
            "that can be stopped when a sample stalls (data.sample_timeout_s: null loads them in this process)"
        )
        return apply_flags(cfg, {"data.num_workers": ("data.num_workers (1 for data.sample_timeout_s)", 1)})
    if wanted <= cores:
        return cfg
    log.info("data.num_workers=%d but this machine has %d CPU cores: using %d DataLoader workers", wanted, cores, cores)
    return apply_flags(cfg, {"data.num_workers": (f"data.num_workers (capped to the {cores} cores)", cores)})


def resumed_batches(loader: DataLoader, pending_rng: dict | None, batches_done: int, bad_inputs=None):
    """iter(loader) (as ``GuardedBatches``), with a resumed run's RNG state restored where the uninterrupted run had
    it: the state saved at an epoch's end is the one the next epoch's iter(loader) drew its worker seed from, so it
    is restored before that draw; one saved mid-epoch (``batches_done`` > 0) was taken after it."""
    if pending_rng is not None and batches_done == 0:
        restore_rng_state(pending_rng)
        pending_rng = None
    batches = GuardedBatches(loader, bad_inputs)
    if pending_rng is not None:
        restore_rng_state(pending_rng)
    return batches


class GuardedBatches:
    """The batches of a loader, with the sample deadline's consequences handled in the main process.

    A DataLoader worker whose sample passes data.sample_timeout_s ends itself after leaving a report
    (datasets.workers.StallWatch); the loader then fails with "worker exited unexpectedly". Here:
    data.on_bad_video raise: StalledFile (one line naming the file, window and worker; exit 2), the other workers
    ended with the iterator; skip: the sample is recorded as a bad file (reported like any, once) and the loader
    restarts at the batch that was not delivered, without that sample (its place taken as a bad file's is), so
    the epoch's sample order, and with it exact resume, is unchanged. The restart draws nothing from the run's
    random state.
    """

    def __init__(self, loader: DataLoader, bad_inputs: BadInputReport | None = None):
        self.loader, self.bad_inputs = loader, bad_inputs
        self.start, self.delivered = getattr(loader.sampler, "start", 0), 0
        self.iterator = iter(loader)  # now, as iter(loader) would: the worker seeds' draw happens here

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while True:
            try:
                with watchdog.not_counting():  # a sample has its own deadline: waiting for one is not a stall
                    batch = next(self.iterator)
            except RuntimeError:
                report = take_stall_report(self.loader.dataset)
                if report is None:
                    raise
                self._restart(report)
                continue
            self.delivered += 1
            return batch

    def _restart(self, report: dict) -> None:
        del self.iterator  # its workers are shut down
        dataset = self.loader.dataset
        if dataset.cfg.on_bad_video == "raise":
            raise StalledFile(report["message"] + "; set data.on_bad_video: skip to go on without it")
        dataset.timed_out[report["index"]] = report["message"]
        skipped = {"skipped": {dataset.path_of(report["index"]): report["message"]}}
        if self.bad_inputs is not None:
            self.bad_inputs.take(skipped)  # one line now, and in the epoch's and the run's lists
        else:
            log.warning("skipping %s", report["message"])
        sampler = self.loader.sampler
        sampler.set_epoch(sampler.epoch, start=self.start + self.delivered * self.loader.batch_size)
        rng = torch.get_rng_state()
        self.iterator = iter(self.loader)
        torch.set_rng_state(rng)


class TrainingData(NamedTuple):
    """What a run trains and validates on (unpacks as the 4-tuple it was)."""

    train_set: Dataset
    val_set: Dataset | None
    class_names: list
    shape: DataShape  # what the model is built for: views, keypoints, classes


def build_data(cfg: Config) -> TrainingData:
    """The training and validation sets of ``cfg``'s manifests, their class names and the data's shape."""
    index_cache = index_cache_for(cfg)
    train_records, val_records = training_records(cfg.data, labelled=cfg.train.reads_labels)
    class_names = resolve_class_names(cfg.data, train_records)
    train_set = build_dataset(cfg, "train", class_names, training=True, index_cache=index_cache, records=train_records)
    val_set = (
        build_dataset(cfg, "val", class_names, training=False, index_cache=index_cache, records=val_records)
        if val_records is not None
        else None
    )
    if cfg.model.model_class_num not in (None, len(class_names)):
        raise ConfigError(
            f"model.model_class_num={cfg.model.model_class_num} but the data has "
            f"{len(class_names)} classes ({', '.join(class_names)}); set it to null or fix the data"
        )
    return TrainingData(train_set, val_set, class_names, DataShape.of_dataset(train_set, class_names))
