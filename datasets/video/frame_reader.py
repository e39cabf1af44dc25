"""What both exact decoders share (``FrameReader``): the read of chosen frames into one array, a decoded frame
stored as displayed at the reader's size (so both give the same pixels), and a file found shorter than its header
says. The decoders: ``opencv_reader.OpenCVReader`` and ``pyav_reader.PyAVReader``."""

from __future__ import annotations

import logging
from typing import Sequence

import cv2
import numpy as np

from datasets.orientation import NONE, Orientation
from datasets.video.info import REENCODE_HINT, VideoInfo, VideoReadError
from datasets.video.probe import probe

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger

# What reading taught about a file, kept for the rest of the process (a worker opens a file many times)
_SHORT_FILES: dict[str, int] = {}  # decoding ends before the container's frame count: the real length


class FrameReader:
    """Reads chosen frames of one video; keep it open to read several windows of the same file. A decoder
    implements ``_read_one`` (one frame into the caller's array), ``_count_frames`` and ``close``."""

    decoder = ""

    def __init__(
        self,
        path: str,
        size: Sequence[int] | None = None,
        threads: int | None = None,
        info: VideoInfo | None = None,
        seek_threshold: int = 48,
        autorotate: bool = True,
    ):
        """size: (height, width) of the returned frames, None = as displayed (as stored with autorotate False).
        threads: FFmpeg decoder threads (None = the library's choice; 1 inside DataLoader workers). seek_threshold:
        read through gaps up to this many frames rather than seek (a seek decodes from the previous keyframe).
        autorotate: frames turned by the container's display matrix, as a viewer sees them."""
        self.path = path
        self.info = info or probe(path, self.decoder)
        self.autorotate = autorotate
        self.orientation = Orientation.named(self.info.orientation) if autorotate else NONE
        # lowered if decoding ends before the container's count
        self.num_frames = min(self.info.num_frames, _SHORT_FILES.get(path, self.info.num_frames))
        self.size = None if size is None else (int(size[0]), int(size[1]))
        self.threads = threads
        self.seek_threshold = seek_threshold
        self.stats = {"seeks": 0, "grabbed": 0, "decoded": 0, "seek_checks": 0}

    # -------------------------------------------------------------------------------------------- public
    def read(self, indices: Sequence[int]) -> np.ndarray:
        """Frames at ``indices`` (any order, repeats allowed) as [N, H, W, 3] RGB uint8.

        Indices past the real end of a video whose container over-states its length get its last frame
        (a warning names the file once); ``num_frames`` then holds the real length.
        """
        indices = [int(i) for i in indices]
        if not indices:
            raise ValueError("read() needs at least one frame index")
        if min(indices) < 0:
            raise VideoReadError(f"{self.path}: negative frame index {min(indices)}")
        wanted = sorted(set(indices))
        height, width = self.size or self.info.frame_size(self.autorotate)
        # frames are converted straight into this array: no per-frame allocation, no stacking copy
        out = np.empty((len(wanted), height, width, 3), np.uint8)
        got: list[int] = []  # out[k] holds frame got[k]
        for index in wanted:
            while index < self.num_frames:  # each failed read lowers num_frames, so this ends
                if self._read_one(index, out[len(got)]):
                    got.append(index)
                    break
            if index >= self.num_frames:  # the rest lie past the real end as well
                break
        if len(got) == len(wanted) and wanted == indices:
            return out
        if len(got) < len(wanted):  # indices past the end get the last frame
            while not got or got[-1] != self.num_frames - 1:  # each failed read lowers num_frames, so this ends
                if self.num_frames <= 0:
                    raise VideoReadError(f"{self.path}: no frame could be decoded; {REENCODE_HINT}")
                if self._read_one(self.num_frames - 1, out[len(got)]):
                    got.append(self.num_frames - 1)
        last = self.num_frames - 1
        slot = {index: k for k, index in enumerate(got)}
        return out[[slot[min(i, last)] for i in indices]]

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------------------ internal
    def _read_one(self, index: int, dst: np.ndarray) -> bool:
        """Decode frame ``index`` into ``dst`` (RGB, resized); False if the stream ended before it."""
        raise NotImplementedError

    def _count_frames(self, limit: int) -> int:
        """Frames decoded from the start before the stream ends or fails, ``limit`` at most."""
        raise NotImplementedError

    def _store(self, bgr: np.ndarray, dst: np.ndarray) -> None:
        """A decoded frame (BGR, as stored) into ``dst`` (RGB, as displayed, at the reader's size): resized in the
        stored orientation (fewer pixels to turn), then turned. Both decoders store through here, so they give
        the same pixels."""
        target = self.orientation.stored(dst.shape[:2])
        if bgr.shape[:2] != target:
            bgr = resize_frame(bgr, target[0], target[1])
        if self.orientation == NONE:
            cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB, dst=dst)
        else:
            self.orientation.apply(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), dst)

    def _ended_at(self, index: int, length: int | None = None) -> bool:
        """Decoding ended (or failed on damaged data) at ``index``, before the file's frame count: the video is
        shorter. ``length``: the frames decodable from the start, if already counted.

        A failed read right after a seek past the real end does not say where the end is, so the frames
        are counted sequentially, once per file.
        """
        self.close()
        length = min(index, self._count_frames(index) if length is None else length)
        self.num_frames = length
        if self.path not in _SHORT_FILES:
            _SHORT_FILES[self.path] = length
            log.warning(
                "%s: the file says %d frames but decoding ends at frame %d (damaged or cut short); the "
                "windows past frame %d shrink",
                self.path,
                self.info.num_frames,
                length,
                length,
            )
        return False


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Downscale by exact 2x box filters (INTER_AREA's fast path), then bilinear for the last < 2x step.

    One INTER_AREA resize with a non-integer ratio costs about 1 ms for 640x360 -> 210x160 (more than the
    decode); this way costs about 0.15 ms with the same anti-aliasing for the large part of the ratio.
    """
    while frame.shape[0] >= 2 * height and frame.shape[1] >= 2 * width:
        frame = cv2.resize(frame, (frame.shape[1] // 2, frame.shape[0] // 2), interpolation=cv2.INTER_AREA)
    if frame.shape[:2] != (height, width):
        frame = cv2.resize(frame, (width, height), interpolation=cv2.INTER_LINEAR)
    return frame
