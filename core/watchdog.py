"""The stall bound of a worker under torchrun (``trainer.stall_timeout_s``): a rank that makes no progress for that
long says where it waits, in one line, and ends, so torchrun restarts the group from last.pt (or, with no restart
left, the run ends) instead of every rank hanging until the process group's timeout.

torchrun restarts a group when a worker dies; a group that hangs (every rank waiting in a collective, or in the
join of a restarted group) kills nothing, so nothing restarts it. The process group's own timeout
(``trainer.process_group_timeout_s``, 600 s) bounds one collective; this bounds the time between two signs of
progress, which the training loop gives: each batch trained, each validation batch (and each chunk group of a
window streamed whole), each precise-BN batch. It
is armed only where every wait is on the group or the model: the join of the group, the weights broadcast, and
the training loop from its first optimizer step on (the first step may compile and search algorithms); waiting
for the data loader does not count (a sample has its own deadline, ``data.sample_timeout_s``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STALL_EXIT_CODE = 3  # torchrun counts it as a failure, as a killed worker


class StallWatchdog:
    """A daemon thread that ends the process when the watched work makes no progress for ``timeout_s``."""

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank = timeout_s, rank
        self.armed, self.paused, self.step, self.warmed = 0, 0, None, False
        self.last = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int | None = None) -> None:
        """Progress; ``step``: the optimizer step reached (the second one this process takes ends its warm-up)."""
        self.last = time.monotonic()
        if step is not None:
            self.warmed = self.warmed or (self.step is not None and step > self.step)
            self.step = step

    @contextlib.contextmanager
    def armed_for(self):
        """Progress is expected inside: a stall ends the process."""
        self.armed += 1
        self.beat()
        try:
            yield
        finally:
            self.armed -= 1

    @contextlib.contextmanager
    def not_counting(self):
        """A wait with its own deadline (the data loader's): not a stall of the group."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1
            self.beat()

    def warming_up(self):
        """The first steps of this process (compilation, algorithm search): not counted; once a step has been
        taken after them (``beat``), every step is."""
        return contextlib.nullcontext() if self.warmed else self.not_counting()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        period = min(max(self.timeout_s / 10, 0.05), 5.0)
        while not self._stopped.wait(period):
            if self.armed and not self.paused and time.monotonic() - self.last > self.timeout_s:
                self._end()

    def _end(self) -> None:
        step = f" after step {self.step}" if self.step is not None else ""
        print(
            f"error: rank {self.rank}: no progress for {self.timeout_s:g} s{step} (trainer.stall_timeout_s), waiting "
            f"in {where_main_waits()}; this process ends so torchrun restarts the group from last.pt",
            file=sys.stderr,
            flush=True,
        )
        os._exit(STALL_EXIT_CODE)


def where_main_waits() -> str:
    """Where the main thread is: its innermost call, and the project's line that led there."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "an unknown place (the main thread has ended)"
    stack = traceback.extract_stack(frame)
    inner = stack[-1]
    ours = [f for f in stack if f.filename.startswith(ROOT + os.sep) and os.sep + ".venv" + os.sep not in f.filename]
    here = f"{inner.name} ({_short(inner.filename)}:{inner.lineno})"
    if ours and ours[-1] is not inner:
        here += f", called from {_short(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})"
    return here


def _short(path: str) -> str:
    parts = path.split(os.sep)
    if "site-packages" in parts:  # a library's file: from its package on
        return os.sep.join(parts[parts.index("site-packages") + 1 :])
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


_watchdog: StallWatchdog | None = None


def start(timeout_s: float | None, rank: int) -> None:
    """The process's watchdog (none without a bound); armed later, where progress is expected."""
    global _watchdog
    if timeout_s is not None and _watchdog is None:
        _watchdog = StallWatchdog(timeout_s, rank)


def stop() -> None:
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


def armed():
    return _watchdog.armed_for() if _watchdog is not None else contextlib.nullcontext()


def not_counting():
    return _watchdog.not_counting() if _watchdog is not None else contextlib.nullcontext()


def warming_up():
    return _watchdog.warming_up() if _watchdog is not None else contextlib.nullcontext()


def beat(step: int | None = None) -> None:
    if _watchdog is not None:
        _watchdog.beat(step)
