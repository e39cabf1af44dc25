"""``eval.py --watch``: evaluate each checkpoint of a run directory exactly once, safely from cron.

- A checkpoint is identified by the SHA-256 of its content: a re-written ``last.pt`` is evaluated again, an
  unchanged one is not. Results are lines of ``RUN_DIR/eval.jsonl``.
- A lock (``RUN_DIR/.eval.lock``, a POSIX record lock) makes a second concurrent run exit at once with code 0.
  The kernel drops the lock when its process dies, so a lock file left by a killed run is simply taken over.
- A checkpoint still being written (modified less than ``--settle`` seconds ago, or changing while it is hashed)
  is left for the next run; temporary files (``.name.tmp``) are never candidates. One that cannot be loaded
  (torn, corrupt, pickled code) is recorded as failed and not retried until its content changes.
- ``eval.jsonl`` is rewritten atomically (temp file, fsync, rename) for each new line: a run killed at any
  moment leaves every earlier line intact and no partial line.
- Exit codes: 0 nothing to do or all evaluated, 1 some checkpoint failed, 2 usage or configuration error.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

from artifacts.ledger import DirectoryLock, read_ledger
from artifacts.plots import eval_history_plot
from artifacts.run_dir import WatchedDirectory
from core.errors import UsageError
from core.files import remove_stale_temp_files

log = logging.getLogger("longvideo")


@dataclass(frozen=True)
class WatchSpec:
    """What eval.py --watch does: which folder, how often, what it records and draws."""

    run_dir: str
    interval: float | None = None  # seconds between passes; None: one pass (cron)
    settle: float = 5.0  # checkpoints modified more recently are left for the next pass
    plot: bool = False
    verbose: bool = False
    split: str = "val"  # what is evaluated, recorded in each eval.jsonl line
    lock_limit: float = 7200.0  # a lock held longer than this (seconds) is reported as a stuck evaluator


class WatchPass(NamedTuple):
    """What one pass over a run's checkpoints did, each a count of checkpoints."""

    evaluated: int
    failed: int
    skipped: int  # already evaluated (their sha256 is in the ledger)
    waiting: int  # still being written: left for the next pass


def plot_history(run_dir: str) -> str | None:
    watched = WatchedDirectory(run_dir)
    return eval_history_plot(read_ledger(watched.ledger), watched.history_png)


def watch(spec: WatchSpec, watch_pass) -> int:
    """Evaluate every new checkpoint under spec.run_dir once, under the directory's lock: ``watch_pass()`` is
    eval.py's pass over its checkpoints (a ``WatchPass``); once, or every spec.interval seconds."""
    if not os.path.isdir(spec.run_dir):
        raise UsageError(f"--watch {spec.run_dir}: not a directory (expected runs/<experiment> or one run)")
    log.setLevel(logging.INFO if spec.verbose else logging.WARNING)
    while True:
        lock = DirectoryLock(WatchedDirectory(spec.run_dir).lock)
        if not lock.acquire():
            held = lock.held_for()
            if held is not None and held > spec.lock_limit:
                # a stuck evaluator (a stalled file, a hung device) would otherwise make every cron run skip quietly
                pid = lock.previous_holder.split()[1]
                print(
                    f"eval.py --watch {spec.run_dir}: {lock.path} has been held for {held / 3600:.1f} h, longer "
                    f"than --lock-limit {spec.lock_limit:g} s, by {lock.previous_holder}; if that evaluation is "
                    f"stuck, stop it (kill {pid}): the lock is released when its process ends"
                )
                return 1
            print(
                f"eval.py --watch {spec.run_dir}: another evaluation holds {lock.path} ({lock.previous_holder}); "
                f"exiting"
            )
            return 0
        try:
            if lock.previous_holder:
                log.info("took over the lock left by %s", lock.previous_holder)
            removed = remove_stale_temp_files(spec.run_dir, recursive=True)
            if removed:
                log.warning(
                    "removed %d temporary file(s) left by writers that were killed: %s",
                    len(removed),
                    ", ".join(removed),
                )
            evaluated, failed, skipped, waiting = watch_pass()
            if spec.plot:
                plot_history(spec.run_dir)
        finally:
            lock.release()
        if evaluated + failed + skipped + waiting == 0:
            print(f"eval.py --watch {spec.run_dir}: nothing to evaluate yet (no checkpoint under it)")
        else:
            print(
                f"eval.py --watch {spec.run_dir}: {evaluated} evaluated, {failed} failed, {skipped} already done, "
                f"{waiting} left for the next run"
            )
        if not spec.interval:
            return 1 if failed else 0
        time.sleep(spec.interval)
