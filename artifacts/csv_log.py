"""CSV logs of a run (metrics.csv, memory.csv): a row appended per call, columns added when new keys appear."""
from __future__ import annotations

import csv
import io
import os

from core.files import atomic_write_bytes


class CsvLog:
    """Appends rows of plain values to a CSV file; the header comes from the first row."""

    def __init__(self, path: str):
        self.path = path
        self.fields: list[str] | None = None
        if os.path.exists(path):
            with open(path, newline="") as f:
                self.fields = next(csv.reader(f), None)

    def write(self, row: dict) -> None:
        new = self.fields is None
        if new:
            self.fields = list(row)
        elif any(key not in self.fields for key in row):  # e.g. val_* after epochs without validation
            self._add_columns([key for key in row if key not in self.fields])
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)

    def _add_columns(self, names: list[str]) -> None:
        """Rewrite the file (atomically) with the new columns, empty in the earlier rows."""
        with open(self.path, newline="") as f:
            rows = list(csv.DictReader(f))
        self.fields = self.fields + names
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.fields)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(self.path, text.getvalue().encode())
