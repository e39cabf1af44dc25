"""Frame-exact video reading with OpenCV: decode only the frames a sample uses.

``VideoReader(path, size).read(indices)`` returns exactly those frames (RGB uint8, resized as each frame
is decoded). It seeks (``CAP_PROP_POS_FRAMES``) to the first needed frame, ``grab()``s over frames it
does not need and ``retrieve()``s only the needed ones, seeking again when the next needed frame is far
ahead. OpenCV's seek lands on the wrong frame for some files (opencv#9053, #4890, #20227), so after
every seek the reader compares the timestamp of the frame it got with the one expected; on a mismatch
it decodes the same frame sequentially once to decide. If the seek was wrong the file is read
sequentially from then on (logged once): never a wrong frame in silence.
"""
from __future__ import annotations

import logging
from typing import Sequence

import cv2
import numpy as np

from datasets.orientation import NONE, Orientation
from datasets.video import capture
from datasets.video.info import REENCODE_HINT, VideoInfo, VideoReadError
from datasets.video.probe import probe

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger

# What reading taught about a file, kept for the rest of the process (a worker opens a file many times):
_INEXACT_SEEK_FILES: set[str] = set()  # seek found wrong: read sequentially
_SHORT_FILES: dict[str, int] = {}  # decoding ends before the container's frame count: the real length


class VideoReader:
    """Reads chosen frames of one video; keep it open to read several windows of the same file."""

    decoder = "opencv"

    def __init__(self, path: str, size: Sequence[int] | None = None, threads: int | None = None,
                 info: VideoInfo | None = None, seek_threshold: int = 48, autorotate: bool = True):
        """size: (height, width) of the returned frames, None = as displayed (as stored with autorotate False).
        threads: FFmpeg decoder threads (None = OpenCV's choice; 1 inside DataLoader workers). seek_threshold:
        read through gaps up to this many frames rather than seek (a seek decodes from the previous keyframe).
        autorotate: frames turned by the container's display matrix, as a viewer sees them (data.autorotate)."""
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
        self._cap: cv2.VideoCapture | None = None
        self._next = 0  # index of the frame the next grab() returns
        self._timestamp_offset_ms = 0.0
        self._bgr: np.ndarray | None = None  # decode buffer, reused frame after frame
        if not self.info.regular_timestamps and path not in _INEXACT_SEEK_FILES:
            _INEXACT_SEEK_FILES.add(path)
            log.warning("%s: its timestamps skip frames or vary (dropped frames, variable frame rate), so a seek "
                        "would not find frame i of a sequential decode; reading it sequentially (slower, but exact)",
                        path)

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
        if self._cap is not None:
            self._cap.release()
            self._cap = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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
        log.warning("%s: OpenCV's seek is not frame-exact for this file (asked for frame %d, timestamps say "
                    "%.1f); reading it sequentially from now on (slower, but exact)", self.path, index,
                    got_ms / frame_ms)
        self.close()
        return False

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
            log.warning("%s: the file says %d frames but decoding ends at frame %d (damaged or cut short); the "
                        "windows past frame %d shrink", self.path, self.info.num_frames, length, length)
        return False

    def _count_frames(self, limit: int) -> int:
        """Frames decoded from the start before the stream ends or fails, ``limit`` at most."""
        cap = self._capture()
        length = 0
        while length < limit and cap.grab():
            length += 1
        self.close()
        return length


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
