"""Video metadata cached across runs (``<trainer.output_dir>/.video_index.json``)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict

from core.files import atomic_write_bytes
from datasets.video import probe as probing
from datasets.video.info import VideoInfo

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger


class VideoIndexCache:
    """Video metadata per file, keyed by path, size and mtime, in a JSON file written atomically.

    Probing thousands of videos takes minutes; the second start reads this file instead.
    """

    def __init__(self, path: str | None):
        self.path = path
        self.entries: dict = {}
        self.dirty = False
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    self.entries = json.load(f)
            except (OSError, ValueError):
                log.warning("%s: unreadable video index cache; rebuilding it", path)

    @staticmethod
    def _key(path: str) -> tuple[str, list]:
        stat = os.stat(path)
        return os.path.abspath(path), [stat.st_size, stat.st_mtime_ns]

    def info(self, path: str, decoder: str = "opencv", prober=None) -> VideoInfo:
        """The cached metadata, else ``prober(path, decoder)``'s (``probe`` by default, or a Prober with a
        deadline)."""
        try:
            key, stamp = self._key(path)
        except OSError:
            return probing.probe(path, decoder)  # raises the clear error for a missing file
        entry = self.entries.get(key)
        if entry and entry.get("stamp") == stamp and entry["info"].keys() == VideoInfo.__dataclass_fields__.keys():
            info = VideoInfo(**entry["info"])
            if info.opencv_decodes or decoder in ("pyav", "auto"):
                return info
        info = (prober or probing.probe)(path, decoder)
        self.entries[key] = {"stamp": stamp, "info": asdict(info)}
        self.dirty = True
        return info

    def save(self) -> None:
        if not (self.path and self.dirty):
            return
        atomic_write_bytes(self.path, json.dumps(self.entries).encode())
        self.dirty = False
