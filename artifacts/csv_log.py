"""CSV logs of a run (metrics.csv, memory.csv): a row appended per call, columns added when new keys appear.

A row is appended whole or not at all (``core.files.append_whole``): a full disk leaves no partial row. A row torn
by a kill mid-write is cut off when the log is opened again (on resume), with one warning.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from collections.abc import Callable

from core.files import append_whole, atomic_write_bytes, repair_torn_tail

log = logging.getLogger("longvideo")


class CsvLog:
    """Appends rows of plain values to a CSV file; the header comes from the first row."""

    def __init__(self, path: str, mirror: Callable[[dict], None] | None = None):
        self.path, self.mirror = path, mirror  # mirror: each row appended also goes there (TensorBoard)
        self.fields: list[str] | None = None
        torn = repair_torn_tail(path)
        if torn:
            log.warning(
                "%s: its last row was cut short (a run killed or a disk full while writing it): removed %d bytes",
                path,
                torn,
            )
        if os.path.exists(path):
            with open(path, newline="") as f:
                self.fields = next(csv.reader(f), None)

    def write(self, row: dict) -> None:
        new = self.fields is None
        if new:
            self.fields = list(row)
        elif any(key not in self.fields for key in row):  # e.g. val_* after epochs without validation
            self._add_columns([key for key in row if key not in self.fields])
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)
        try:
            append_whole(self.path, text.getvalue().encode())
        except BaseException:
            if new:
                self.fields = None  # the header was not written either
            raise
        if self.mirror is not None:
            self.mirror(row)

    def rows(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f))

    def _add_columns(self, names: list[str]) -> None:
        """Rewrite the file (atomically) with the new columns, empty in the earlier rows."""
        self._rewrite(self.rows(), self.fields + names)

    def _rewrite(self, rows: list[dict], fields: list[str]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(self.path, text.getvalue().encode())
        self.fields = fields

    def keep_rows_of(self, history: list[dict], key: str = "epoch") -> int:
        """On resume: the rows match ``history`` (the checkpoint's record of finished epochs): rows the checkpoint
        does not know (written after it, by a run that then died) are dropped, and rows it knows but the file lacks
        (a run stopped between its checkpoint and its row: a full disk) are written. Returns the rows changed."""
        if not history:
            return 0
        rows = self.rows()
        wanted = {str(row[key]): row for row in history}
        present = {row[key]: row for row in rows if row.get(key) in wanted}  # a repeated epoch: its last row
        missing = [row for k, row in wanted.items() if k not in present]
        if not missing and len(present) == len(rows):
            return 0
        fields = list(self.fields or [])
        fields += [k for row in history for k in row if k not in fields]
        self._rewrite(sorted([*present.values(), *missing], key=lambda row: float(row[key])), fields)
        return len(missing) + len(rows) - len(present)
