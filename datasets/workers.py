"""DataLoader workers: their warnings handed to the main process with a sample, the deadline of a sample
(``StallWatch``) and its report, one OpenCV thread per worker."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import cv2
import torch

from core.files import atomic_write_bytes

WORKER_NOTES: list[str] = []  # warnings met in a DataLoader worker, handed to the main process with a sample


class _NotesHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        WORKER_NOTES.append(record.getMessage())


def worker_init(worker_id: int) -> None:
    """A worker's warnings (a file shorter than its container says, ...) go to the main process with the next
    sample instead of the console: printed once per run there, not once per worker and epoch. With
    data.sample_timeout_s, a watchdog thread ends the worker whose sample passes the deadline (``StallWatch``)."""
    logging.getLogger("longvideo").handlers = [_NotesHandler()]
    info = torch.utils.data.get_worker_info()
    if info is not None and hasattr(info.dataset, "start_watch"):  # a VideoWindowDataset
        info.dataset.start_watch(worker_id)


class StallWatch:
    """The deadline of a sample in a DataLoader worker.

    A sample blocked inside FFmpeg (a file on a stalled network mount, a decoder that never returns) cannot be
    interrupted from Python: no exception reaches a thread waiting in C, and a signal only runs its handler once
    the C call returns. What can always be stopped is the process. So each worker runs this watchdog thread; when
    the sample being loaded passes ``timeout`` seconds it writes a report (file, window, worker) into ``folder``
    and ends the worker (``os._exit``). The main process sees the worker gone, reads the report
    (``take_stall_report``) and acts as data.on_bad_video says (engine.data.loaders.GuardedBatches). A watchdog in the
    worker, not one decode process per sample: the usual path costs one thread and a timestamp per sample.
    """

    def __init__(self, timeout: float, folder: str, worker_id: int, describe):
        self.timeout, self.folder, self.worker_id, self.describe = timeout, folder, worker_id, describe
        self.loading: tuple[float, int] | None = None  # (start, sample index) of the sample being loaded
        threading.Thread(target=self._watch, daemon=True, name="sample-deadline").start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            loading = self.loading
            if loading is not None and time.monotonic() - loading[0] > self.timeout:
                report = {
                    "index": loading[1],
                    "message": f"{self.describe(loading[1])} still loading after "
                    f"{self.timeout:g} s (data.sample_timeout_s) in DataLoader worker {self.worker_id} "
                    f"(pid {os.getpid()}): a stalled mount or a decoder that does not return",
                }
                atomic_write_bytes(os.path.join(self.folder, f"{os.getpid()}.json"), json.dumps(report).encode())
                os._exit(3)  # the only way out of a call blocked in C; the main process takes it from here


def take_stall_report(dataset) -> dict | None:
    """The report of a worker that ended itself on a stalled sample ({"index", "message"}), removed once read."""
    folder = getattr(dataset, "stall_folder", None)
    for name in sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if name.endswith(".json"):
            with open(path) as f:
                report = json.load(f)
            os.unlink(path)
            return report
    return None


def before_workers_fork(num_workers: int) -> None:
    """Workers x decoder threads must not oversubscribe the cores: one OpenCV thread per worker. Set in the
    parent before the workers fork: cv2.setNumThreads in a forked worker deadlocked once the parent had used
    OpenCV's thread pool (one cvtColor of a 720p frame was enough), since the pool's threads are not copied by
    fork but its locks are."""
    if num_workers > 0:
        cv2.setNumThreads(1)
