"""The host memory of the training loader: what the DataLoader holds before and while the steps run.

    batches in flight   num_workers x PREFETCH_FACTOR batches (each worker fills its share ahead of the loop;
                        without workers: the one batch being loaded)
    pinned copies       on CUDA: one page-locked copy of every batch in flight
    the step's group    train.accumulate_grad_batches batches kept until their optimizer step (the OOM replay)
    decoders            a worker's decoding process: the peak RSS python -m bench.loader measured for a process
                        reading one clip (640x360; 67 MB with opencv, 87 MB with pyav), per worker (or the main
                        process without workers)

A batch is data.batch_size clips of uint8 frames (views x 3 x T x H x W at data.img_size) plus float32
keypoints. T is data.num_frames (for -1, the sample window: data.max_video_frames).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from config import Config
from core import memory_monitor
from datasets.shape import DataShape
from engine.data.loaders import PREFETCH_FACTOR
from planner.project import clip_frames

log = logging.getLogger("longvideo")
MB, GB = 2**20, 2**30
DECODER_PROCESS_BYTES = 87 * MB  # python -m bench.loader: peak RSS of a process reading one clip (pyav, the larger)


@dataclass(frozen=True)
class HostEstimate:
    batch: int  # bytes of one loader batch
    in_flight: int
    pinned: int
    group: int
    decoders: int

    @property
    def total(self) -> int:
        return self.in_flight + self.pinned + self.group + self.decoders

    def text(self) -> str:
        return (
            f"{self.total / GB:.2f} GB = {self.in_flight / GB:.2f} GB of batches in flight + {self.pinned / GB:.2f}"
            f" GB pinned copies + {self.group / GB:.2f} GB kept for the step + {self.decoders / GB:.2f} GB of "
            f"decoders (a batch: {self.batch / MB:.0f} MB)"
        )


def loader_host_bytes(cfg: Config, shape: DataShape, cuda: bool) -> HostEstimate:
    data, train_cfg = cfg.data, cfg.train
    height, width = data.img_size
    frames = clip_frames(cfg.data)
    batch_size = data.batch_size if isinstance(data.batch_size, int) else 1
    clip = shape.num_views * 3 * frames * height * width if data.load_rgb else 0
    if data.load_kpt:
        joints, channels = shape.kpt_shape or (17, 3)
        clip += 4 * frames * joints * channels
    batch = batch_size * clip
    workers = data.num_workers
    in_flight = batch * (workers * PREFETCH_FACTOR if workers else 1)
    pinned = in_flight if cuda else 0
    return HostEstimate(
        batch, in_flight, pinned, batch * train_cfg.accumulate_grad_batches, DECODER_PROCESS_BYTES * max(workers, 1)
    )


def warn_if_host_memory_short(cfg: Config, shape: DataShape, cuda: bool) -> str | None:
    """One warning at the start of training when the loader's estimate exceeds the memory this machine has
    available (MemAvailable), naming the switches that lower it; returns it (None when it fits or is unknown)."""
    available = memory_monitor.available_host_bytes()
    estimate = loader_host_bytes(cfg, shape, cuda)
    if available is None or estimate.total <= available:
        return None
    data = cfg.data
    warning = (
        f"host memory: the training loader is estimated at {estimate.text()}, more than the "
        f"{available / GB:.2f} GB this machine has available; lower data.num_workers ({data.num_workers}), "
        f"data.batch_size ({data.batch_size}) or the "
        f"clip (data.num_frames {data.num_frames}, data.max_video_frames {data.max_video_frames})"
    )
    log.warning("%s", warning)
    return warning
