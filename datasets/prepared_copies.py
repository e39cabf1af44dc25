"""Which file a view is read from under ``data.prepared_dir``: its prepared copy when one matches the source and the
config's decode size, GOP and quality (``datasets.video.prepared``), else the source itself, with the reason."""

from __future__ import annotations

import os

from config import DataConfig
from datasets.clip_transform import decode_size
from datasets.video.info import VideoInfo
from datasets.video.prepared import Preparation, find_copy

PREPARE_COMMAND = "python -m datasets.prepare --config CONFIG"
# a copy's keyframe every 16 frames: a random clip decodes at most 16 small frames before its first; x264 at
# constant quality 18, visually lossless
PREPARED_GOP, PREPARED_CRF = 16, 18


def preparation_of(info: VideoInfo, data_cfg: DataConfig) -> Preparation:
    """The preparation a source needs for this config: read at its decode size, turned as the readers turn it."""
    height, width = decode_size(*info.frame_size(), data_cfg)
    return Preparation(height, width, info.orientation, PREPARED_GOP, PREPARED_CRF)


class PreparedCopies:
    """The copies of one dataset's or stream's sources: ``read_from`` gives the (path, VideoInfo) to open for a
    source, and remembers which sources had no usable copy, and why (``summary``)."""

    def __init__(self, data_cfg: DataConfig):
        self.data_cfg, self.folder = data_cfg, data_cfg.prepared_dir
        self.copied: dict[str, str] = {}  # source -> its copy
        self.missing: dict[str, str] = {}  # source -> why it is read itself

    def read_from(self, path: str, info: VideoInfo) -> tuple[str, VideoInfo]:
        if self.folder is None:
            return path, info
        copy, why = find_copy(self.folder, path, preparation_of(info, self.data_cfg))
        if copy is None:
            self.missing[path] = why
            return path, info
        self.copied[path] = copy.path
        return copy.path, copy.info

    def summary(self) -> str | None:
        """One line for the log: how many sources are read from their copies, and the first few that are not."""
        if self.folder is None:
            return None
        total = len(self.copied) + len(self.missing)
        line = f"prepared copies (data.prepared_dir: {self.folder}): {len(self.copied)} of {total} videos read"
        line += " from their copies"
        if self.missing:
            shown = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in list(self.missing.items())[:3])
            more = f" and {len(self.missing) - 3} more" if len(self.missing) > 3 else ""
            line += f"; {len(self.missing)} from their sources ({shown}{more}; {PREPARE_COMMAND} prepares them)"
        return line
