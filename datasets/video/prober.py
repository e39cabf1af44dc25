"""``probe`` with a deadline, in a child process that can be killed when a file stalls."""

from __future__ import annotations

import concurrent.futures
import multiprocessing

from datasets.video.info import StalledFile, VideoInfo
from datasets.video.probe import probe


class Prober:
    """``probe`` in a child process that can be stopped: a file on a stalled mount blocks inside FFmpeg, where no
    thread of ours can interrupt it, so the probe runs in a persistent spawned process (spawn: a fork of a process
    that used OpenCV's thread pool can deadlock) and one that does not answer in ``timeout`` seconds is killed,
    the file reported (StalledFile) and a fresh child started for the next one. ``timeout`` None: in process."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __call__(self, path: str, decoder: str) -> VideoInfo:
        if self.timeout is None:
            return probe(path, decoder)
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self._pool.submit(int).result()  # started and imported: the deadline below is the probe's alone
        future = self._pool.submit(probe, path, decoder)
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            self.close(kill=True)
            raise StalledFile(
                f"{path}: no answer within {self.timeout:g} s while reading its header "
                f"(data.sample_timeout_s): a stalled mount or a corrupt file?"
            ) from None

    def close(self, kill: bool = False) -> None:
        if self._pool is not None:
            if kill:  # the child is blocked: it would never take a shutdown request
                for process in list(getattr(self._pool, "_processes", {}).values()):
                    process.kill()
            self._pool.shutdown(wait=not kill, cancel_futures=True)
            self._pool = None
