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

import json
import logging
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

import cv2
import numpy as np

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger

REENCODE_HINT = "re-encode it, e.g. ffmpeg -i in.mkv -c:v libx264 -pix_fmt yuv420p out.mp4"


class VideoReadError(Exception):
    """A video that cannot be read as asked: the message names the file and what to do."""


@dataclass
class VideoInfo:
    path: str
    num_frames: int
    fps: float
    width: int
    height: int
    codec: str


def _fourcc(cap: cv2.VideoCapture) -> str:
    code = int(cap.get(cv2.CAP_PROP_FOURCC))
    text = "".join(chr((code >> (8 * i)) & 0xFF) for i in range(4)).strip("\x00 ")
    return text if text.isprintable() and text else f"0x{code:08x}"


def _open_capture(path: str, threads: int | None) -> cv2.VideoCapture:
    params = [cv2.CAP_PROP_N_THREADS, threads] if threads and hasattr(cv2, "CAP_PROP_N_THREADS") else []
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, params)
    return cap


def probe(path: str) -> VideoInfo:
    """Frame count, fps, size and codec from the container, plus one decoded frame to prove the codec works."""
    if not os.path.exists(path):
        raise VideoReadError(f"{path}: file not found")
    if os.path.getsize(path) == 0:
        raise VideoReadError(f"{path}: empty file (0 bytes)")
    cap = _open_capture(path, threads=1)
    try:
        if not cap.isOpened():
            raise VideoReadError(f"{path}: OpenCV cannot open this file as a video (not a video, or truncated "
                                 f"before its header ends)")
        count = int(round(cap.get(cv2.CAP_PROP_FRAME_COUNT)))
        fps = float(cap.get(cv2.CAP_PROP_FPS))
        codec = _fourcc(cap)
        if count <= 0:
            raise VideoReadError(f"{path}: the container reports no frames ({codec}); {REENCODE_HINT}")
        ok, frame = cap.read()
        if not ok or frame is None:
            raise VideoReadError(f"{path}: OpenCV opens this file but cannot decode its '{codec}' video "
                                 f"(its FFmpeg build lacks a decoder); {REENCODE_HINT}")
        height, width = frame.shape[:2]
        return VideoInfo(path, count, fps if fps > 0 else 25.0, width, height, codec)
    finally:
        cap.release()


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

    def info(self, path: str) -> VideoInfo:
        try:
            key, stamp = self._key(path)
        except OSError:
            return probe(path)  # raises the clear error for a missing file
        entry = self.entries.get(key)
        if entry and entry.get("stamp") == stamp:
            return VideoInfo(**entry["info"])
        info = probe(path)
        self.entries[key] = {"stamp": stamp, "info": asdict(info)}
        self.dirty = True
        return info

    def save(self) -> None:
        if not (self.path and self.dirty):
            return
        from checkpoint import atomic_write_bytes  # late: checkpoint imports torch, this module does not
        atomic_write_bytes(self.path, json.dumps(self.entries).encode())
        self.dirty = False


# What reading taught about a file, kept for the rest of the process (a worker opens a file many times):
_INEXACT_SEEK_FILES: set[str] = set()  # seek found wrong: read sequentially
_SHORT_FILES: dict[str, int] = {}  # decoding ends before the container's frame count: the real length


class VideoReader:
    """Reads chosen frames of one video; keep it open to read several windows of the same file."""

    def __init__(self, path: str, size: Sequence[int] | None = None, threads: int | None = None,
                 info: VideoInfo | None = None, seek_threshold: int = 48):
        """size: (height, width) of the returned frames, None = as stored. threads: FFmpeg decoder threads
        (None = OpenCV's choice; 1 inside DataLoader workers). seek_threshold: read through gaps up to this
        many frames rather than seek (a seek decodes from the previous keyframe)."""
        self.path = path
        self.info = info or probe(path)
        # lowered if decoding ends before the container's count
        self.num_frames = min(self.info.num_frames, _SHORT_FILES.get(path, self.info.num_frames))
        self.size = None if size is None else (int(size[0]), int(size[1]))
        self.threads = threads
        self.seek_threshold = seek_threshold
        self.stats = {"seeks": 0, "grabbed": 0, "decoded": 0, "seek_checks": 0}
        self._cap: cv2.VideoCapture | None = None
        self._next = 0  # index of the frame the next grab() returns
        self._timestamp_offset_ms = 0.0
        self._bgr: np.ndarray | None = None  # decode buffer when resizing, reused frame after frame

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
        height, width = self.size or (self.info.height, self.info.width)
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
        last = self.num_frames - 1
        if len(got) < len(wanted) and (not got or got[-1] != last):  # indices past the end get the last frame
            if last < 0 or not self._read_one(last, out[len(got)]):
                raise VideoReadError(f"{self.path}: no frame could be decoded; {REENCODE_HINT}")
            got.append(last)
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
            self._cap = _open_capture(self.path, self.threads)
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
        resize = (self.info.height, self.info.width) != dst.shape[:2]
        # native size: decode straight into the caller's array; else into a reused buffer, then resize
        ok, frame = cap.retrieve(self._bgr if resize else dst)
        if not ok or frame is None:
            return self._ended_at(index)
        self._next = index + 1
        if seeked and not self._landed_on(index, frame):
            return self._read_one(index, dst)  # now in sequential mode
        self.stats["decoded"] += 1
        if resize:
            self._bgr = frame
            frame = resize_frame(frame, dst.shape[0], dst.shape[1])
        cv2.cvtColor(frame, cv2.COLOR_BGR2RGB, dst=dst)  # in place at native size
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
        reference = _decode_sequentially(self.path, index)
        if reference is not None and np.array_equal(reference, frame):
            self._timestamp_offset_ms = got_ms - index * frame_ms
            return True
        _INEXACT_SEEK_FILES.add(self.path)
        log.warning("%s: OpenCV's seek is not frame-exact for this file (asked for frame %d, timestamps say "
                    "%.1f); reading it sequentially from now on (slower, but exact)", self.path, index,
                    got_ms / frame_ms)
        self.close()
        return False

    def _ended_at(self, index: int) -> bool:
        """A grab failed at ``index``, before the container's frame count: the video is shorter.

        A failed read right after a seek past the real end does not say where the end is, so the frames
        are counted sequentially, once per file.
        """
        self.close()
        cap = self._capture()
        length = 0
        while length < index and cap.grab():
            length += 1
        self.close()
        self.num_frames = length
        if self.path not in _SHORT_FILES:
            _SHORT_FILES[self.path] = length
            log.warning("%s: the container says %d frames but decoding ends at frame %d; the windows past "
                        "frame %d shrink", self.path, self.info.num_frames, length, length)
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


def _decode_sequentially(path: str, index: int) -> np.ndarray | None:
    cap = _open_capture(path, threads=None)
    try:
        for _ in range(index):
            if not cap.grab():
                return None
        ok, frame = cap.read()
        return frame if ok else None
    finally:
        cap.release()


class ReaderCache:
    """The last few open readers of a process (a DataLoader worker reads consecutive windows of a video)."""

    def __init__(self, capacity: int = 4, threads: int | None = 1):
        self.capacity, self.threads = capacity, threads
        self._readers: OrderedDict = OrderedDict()

    def get(self, path: str, size, info: VideoInfo | None = None) -> VideoReader:
        key = (path, None if size is None else tuple(size))
        reader = self._readers.pop(key, None)
        if reader is None:
            reader = VideoReader(path, size, threads=self.threads, info=info)
            while len(self._readers) >= self.capacity:
                self._readers.popitem(last=False)[1].close()
        self._readers[key] = reader
        return reader

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
