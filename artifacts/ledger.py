"""The cron evaluator's record of a run directory: ``eval.jsonl`` (one JSON line per evaluated checkpoint,
rewritten atomically for each new line) and the lock that keeps two evaluators apart."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import time

from core.files import atomic_write_bytes, naming_disk_errors

log = logging.getLogger("longvideo")


_HOLDER = re.compile(r"since \S+ \((\d+)\)")


class DirectoryLock:
    """An exclusive, non-blocking lock on a run directory's .eval.lock that dies with its process. The file says
    who holds it and since when: "pid 123 on host since 2026-11-23T10:00:00+0000 (1795432800)"."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None
        self.previous_holder = ""

    def acquire(self) -> bool:
        with naming_disk_errors(self.path):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.previous_holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            return False
        self.previous_holder = os.pread(fd, 200, 0).decode(errors="replace").strip()  # a stale one: taken over
        self.fd = fd
        now = time.time()
        since = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now))
        try:
            with naming_disk_errors(self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since} ({now:.0f})\n".encode(), 0)
        except BaseException:
            self.release()
            raise
        return True

    def held_for(self) -> float | None:
        """Seconds the current holder has held the lock (after a failed acquire), None if it does not say."""
        match = _HOLDER.search(self.previous_holder)
        return time.time() - int(match.group(1)) if match else None

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty file: released cleanly; text left in it: its holder was killed
            os.close(self.fd)
            self.fd = None


def read_ledger(path: str) -> list[dict]:
    """The entries of eval.jsonl; a line that does not parse (written by hand?) is skipped with a warning."""
    if not os.path.exists(path):
        return []
    entries = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s:%d: not a JSON line; ignored", path, number)
    return entries


def append_ledger(path: str, entry: dict) -> None:
    existing = open(path, "rb").read() if os.path.exists(path) else b""
    if existing and not existing.endswith(b"\n"):
        existing += b"\n"
    atomic_write_bytes(path, existing + (json.dumps(entry) + "\n").encode())
