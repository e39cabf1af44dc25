"""The data of a run: datasets from the config's manifests, and their DataLoaders."""
from __future__ import annotations

import logging

from torch.utils.data import DataLoader

from config import apply_flags
from core.errors import ConfigError
from core.runtime import Runtime, available_cores
from datasets.sampler import EpochSampler
from datasets.shape import DataShape
from datasets.video_dataset import (
    before_workers_fork,
    build_dataset,
    collate_samples,
    index_cache_for,
    resolve_class_names,
    training_records,
    worker_init,
)

log = logging.getLogger("longvideo")


def make_loader(dataset, cfg: dict, runtime: Runtime, batch_size: int, shuffle: bool, pad: bool) -> DataLoader:
    """shuffle: a new permutation every epoch (training); pad: equal shards for every rank (training, where DDP
    needs equal step counts; evaluation shards are not padded, so no sample counts twice)."""
    data = cfg["data"]
    sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=cfg["train"]["seed"], rank=runtime.rank,
                           world_size=runtime.world_size, pad=pad)
    before_workers_fork(data["num_workers"])
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                      num_workers=data["num_workers"], worker_init_fn=worker_init, collate_fn=collate_samples,
                      pin_memory=data["pin_memory"] and runtime.device.type == "cuda",
                      drop_last=False, persistent_workers=False)


def cap_workers(cfg: dict) -> dict:
    """No more DataLoader workers than cores (a preset for a 16-core workstation on a 2-core laptop): one line,
    instead of PyTorch's warning once per loader. A new config (the validated one is not changed), so the run's
    config.yaml records what ran."""
    cores, wanted = available_cores(), cfg["data"]["num_workers"]
    if wanted <= cores:
        return cfg
    log.info("data.num_workers=%d but this machine has %d CPU cores: using %d DataLoader workers", wanted, cores,
             cores)
    return apply_flags(cfg, {"data.num_workers": (f"data.num_workers (capped to the {cores} cores)", cores)})


def build_data(cfg: dict) -> tuple:
    """(training set, validation set or None, class names, the data's shape)."""
    index_cache = index_cache_for(cfg)
    train_records, val_records = training_records(cfg["data"])
    class_names = resolve_class_names(cfg["data"], train_records)
    train_set = build_dataset(cfg, "train", class_names, training=True, index_cache=index_cache,
                              records=train_records)
    val_set = build_dataset(cfg, "val", class_names, training=False, index_cache=index_cache,
                            records=val_records) if val_records is not None else None
    if cfg["model"]["model_class_num"] not in (None, len(class_names)):
        raise ConfigError(f"model.model_class_num={cfg['model']['model_class_num']} but the data has "
                          f"{len(class_names)} classes ({', '.join(class_names)}); set it to null or fix the data")
    return train_set, val_set, class_names, DataShape.of_dataset(train_set, class_names)
