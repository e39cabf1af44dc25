"""Frame-exact video reading with OpenCV: decode only the frames a sample uses.

``OpenCVReader(path, size).read(indices)`` returns exactly those frames (RGB uint8, resized as each frame
is decoded). It seeks (``CAP_PROP_POS_FRAMES``) to the first needed frame, ``grab()``s over frames it
does not need and ``retrieve()``s only the needed ones, seeking again when the next needed frame is far
ahead. OpenCV's seek lands on the wrong frame for some files (opencv#9053, #4890, #20227), so after
every seek the reader compares the timestamp of the frame it got with the one expected; on a mismatch
it decodes the same frame sequentially once to decide. If the seek was wrong the file is read
sequentially from then on (logged once): never a wrong frame in silence.
"""

from __future__ import annotations

import logging

import cv2
import numpy as np

from datasets.video import capture
from datasets.video.frame_reader import FrameReader
from datasets.video.info import VideoReadError

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger

_INEXACT_SEEK_FILES: set[str] = set()  # seek found wrong (kept for the process): read sequentially


class OpenCVReader(FrameReader):
    """Reads chosen frames of one video with OpenCV; keep it open to read several windows of the same file."""

    decoder = "opencv"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cap: cv2.VideoCapture | None = None
        self._next = 0  # index of the frame the next grab() returns
        self._timestamp_offset_ms = 0.0
        self._bgr: np.ndarray | None = None  # decode buffer, reused frame after frame
        if not self.info.regular_timestamps and self.path not in _INEXACT_SEEK_FILES:
            _INEXACT_SEEK_FILES.add(self.path)
            log.warning(
                "%s: its timestamps skip frames or vary (dropped frames, variable frame rate), so a seek "
                "would not find frame i of a sequential decode; reading it sequentially (slower, but exact)",
                self.path,
            )

    def close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None

    # ------------------------------------------------------------------------------------------ internal
    def _capture(self) -> cv2.VideoCapture:
        if self._cap is None:
            self._cap = capture.open_capture(self.path, self.threads)
            self._next = 0
            if not self._cap.isOpened():
                raise VideoReadError(f"{self.path}: OpenCV can no longer open this file (moved or truncated?)")
        return self._cap

    @property
    def seeks_exactly(self) -> bool:
        return self.path not in _INEXACT_SEEK_FILES

    def _read_one(self, index: int, dst: np.ndarray) -> bool:
        """Decode frame ``index`` into ``dst`` (RGB, resized); False if the stream ended before it."""
        cap = self._capture()
        seeked = False
        if index < self._next or index - self._next > self.seek_threshold:
            if self.seeks_exactly:
                cap.set(cv2.CAP_PROP_POS_FRAMES, index)
                self._next, seeked = index, True
                self.stats["seeks"] += 1
            elif index < self._next:  # sequential mode: going back means starting over
                self.close()
                cap = self._capture()
        while self._next < index:
            if not cap.grab():
                return self._ended_at(self._next)
            self._next += 1
            self.stats["grabbed"] += 1
        if not cap.grab():
            return self._ended_at(index)
        # Into one reused buffer that stays in cache, then converted into the caller's array: measured 4%
        # faster than decoding straight into the (cold) output array and swapping channels there.
        ok, frame = cap.retrieve(self._bgr)
        if not ok or frame is None:
            return self._ended_at(index)
        self._bgr = frame
        self._next = index + 1
        if seeked and not self._landed_on(index, frame):
            return self._read_one(index, dst)  # now in sequential mode
        self.stats["decoded"] += 1
        self._store(frame, dst)
        return True

    def _landed_on(self, index: int, frame: np.ndarray) -> bool:
        """After a seek: did OpenCV return frame ``index``? Timestamps first; pixels when they disagree."""
        frame_ms = 1000.0 / self.info.fps
        expected_ms = index * frame_ms + self._timestamp_offset_ms
        got_ms = self._cap.get(cv2.CAP_PROP_POS_MSEC)
        if abs(got_ms - expected_ms) < 0.5 * frame_ms:
            return True
        # Timestamps disagree: either the seek was wrong, or this file's timestamps do not start at 0.
        # Decode the same frame sequentially (once per mismatch) and compare pixels to decide.
        self.stats["seek_checks"] += 1
        reference = capture.decode_sequentially(self.path, index)
        if reference is not None and np.array_equal(reference, frame):
            self._timestamp_offset_ms = got_ms - index * frame_ms
            return True
        _INEXACT_SEEK_FILES.add(self.path)
        log.warning(
            "%s: OpenCV's seek is not frame-exact for this file (asked for frame %d, timestamps say "
            "%.1f); reading it sequentially from now on (slower, but exact)",
            self.path,
            index,
            got_ms / frame_ms,
        )
        self.close()
        return False

    def _count_frames(self, limit: int) -> int:
        """Frames decoded from the start before the stream ends or fails, ``limit`` at most."""
        cap = self._capture()
        length = 0
        while length < limit and cap.grab():
            length += 1
        self.close()
        return length
