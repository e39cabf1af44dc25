"""TensorBoard, optional (``trainer.tensorboard``): every scalar of metrics.csv (at each epoch) and memory.csv (at
each of its rows) also goes to ``<run>/tb/`` as TensorBoard events, when the ``tensorboard`` package is installed.
Without it (``auto``), nothing changes and nothing is said; ``true`` without it is a config error.

The events are a mirror of the CSVs, which hold every number: a write that fails for a full disk turns the mirror
off with one warning and the run goes on (its checkpoints and CSVs decide whether it can). Each event is appended
as one whole record through ``core.files.append_whole`` (TensorBoard's own writer appends from a thread that
prints a traceback and can leave half a record), so a file cut short by a full disk still reads to its last
event."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import logging
import math
import os
import socket
import time
from collections.abc import Callable

from core.files import DiskFullError, append_whole, naming_disk_errors

log = logging.getLogger("longvideo")
_FILE_NUMBERS = itertools.count()  # two logs of one process in one second get two files


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def wanted(setting: bool | str) -> bool:
    """trainer.tensorboard: true, or auto with the package installed (config refuses true without it)."""
    return setting is True or (setting == "auto" and available())


class TensorBoardLog:
    """Scalars of a run's CSV rows as TensorBoard events in a new event file of ``directory``; ``purge_step``: a
    resumed run's step, past which TensorBoard hides the events of the run before (they were not kept: the run
    goes on from its checkpoint)."""

    def __init__(self, directory: str, purge_step: int | None = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # optional: only when it is wanted
        from tensorboard.compat.proto.summary_pb2 import Summary  # (the same)
        from tensorboard.summary.writer.record_writer import RecordWriter  # (the same)

        self._event, self._summary, self._record_writer = Event, Summary, RecordWriter
        self.directory = directory
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_NUMBERS)}"
        self.path: str | None = os.path.join(directory, name)  # None: turned off by a full disk
        first = [Event(wall_time=time.time(), file_version="brain.Event:2")]
        if purge_step is not None:  # what torch's SummaryWriter writes for purge_step
            first.append(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._append(first)

    def _append(self, events: list) -> None:
        """``events`` as whole records at the end of the file; a full disk turns the log off with one warning."""
        if self.path is None:
            return
        framed = _Framed()
        for event in events:
            self._record_writer(framed).write(event.SerializeToString())
        try:
            with naming_disk_errors(self.path):
                os.makedirs(self.directory, exist_ok=True)
            append_whole(self.path, framed.data)
        except DiskFullError as e:
            with contextlib.suppress(OSError):
                if os.path.getsize(self.path) == 0:  # created by this write: no empty file is left behind
                    os.unlink(self.path)
            log.warning(
                "%s; TensorBoard events stop here for this run (metrics.csv and memory.csv keep every number)", e
            )
            self.path = None

    def mirror(self, prefix: str, step_key: str) -> Callable[[dict], None]:
        """What a CsvLog calls with each row it appended: its numbers as scalars ``prefix + column`` at the row's
        ``step_key``."""

        def write(row: dict) -> None:
            values = [
                self._summary.Value(tag=prefix + key, simple_value=value)
                for key, value in row.items()
                if key != step_key
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ]
            if values:
                summary = self._summary(value=values)
                self._append([self._event(wall_time=time.time(), step=int(row[step_key]), summary=summary)])

        return write


class _Framed:
    """The file object RecordWriter frames a record into, kept in memory to be appended whole."""

    def __init__(self):
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data
