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

import concurrent.futures
import importlib.util
import itertools
import json
import logging
import multiprocessing
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Sequence

import cv2
import numpy as np

from core.files import atomic_write_bytes
from datasets.orientation import NONE, Orientation

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger

REENCODE_HINT = "re-encode it, e.g. ffmpeg -i in.mkv -c:v libx264 -pix_fmt yuv420p out.mp4"


def quiet_decoder_logs(verbose: bool = False) -> None:
    """FFmpeg's, OpenCV's and PyAV's own log lines ("[mov,mp4,...] moov atom not found", "[ WARN:0@...] cap.cpp")
    would surround the one-line error the scripts print for a bad file: each script's main() quiets them, unless
    ``verbose`` or the user set OPENCV_FFMPEG_LOGLEVEL / OPENCV_LOG_LEVEL. OpenCV reads the FFmpeg level when it
    first opens a video and its own level at import, so the latter is also set here; DataLoader workers inherit
    both."""
    if verbose:
        return
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")
    if "OPENCV_LOG_LEVEL" not in os.environ:
        os.environ["OPENCV_LOG_LEVEL"] = "ERROR"
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)
    if importlib.util.find_spec("av") is not None:  # PyAV's FFmpeg prints to stderr by itself ("Invalid NAL unit")
        import av.logging  # lazy: PyAV is optional at run time

        av.logging.set_libav_level(av.logging.PANIC)  # not set_level: a Python callback from decoder threads


class VideoReadError(Exception):
    """A video that cannot be read as asked: the message names the file and what to do."""


@dataclass
class VideoInfo:
    path: str
    num_frames: int  # the frames the file holds (its packets), which the header's count may misstate
    fps: float
    width: int  # as displayed: the container's display matrix (a phone's rotation) applied
    height: int
    codec: str
    # the packet timestamps number every frame one by one (no dropped frames, constant rate): seeking by
    # timestamp finds frame i of a sequential decode. False: the file is read sequentially (exact, slower).
    regular_timestamps: bool = True
    # every video stream of the file, in file order, as [width, height, frames]: both decoders read the first
    video_streams: list = field(default_factory=list)
    # False: OpenCV's FFmpeg build cannot decode this codec (AV1 in the pip wheel) but PyAV can: pyav only
    opencv_decodes: bool = True
    # how a stored frame is turned for display (datasets.orientation names: none, rotate90, mirror, ...)
    orientation: str = "none"
    # the frame count the container's header states; differs from num_frames when the header misstates it (a
    # file cut short, an MKV Duration written wrong)
    header_frames: int = 0

    def frame_size(self, autorotate: bool = True) -> tuple[int, int]:
        """(height, width) of the frames read with ``data.autorotate``: as displayed, or as stored."""
        return (self.height, self.width) if autorotate else Orientation.named(self.orientation).stored(
            (self.height, self.width))

    def header_note(self) -> str | None:
        """The warning for a header whose frame count is wrong, or None."""
        if abs(self.header_frames - self.num_frames) <= 1:  # a duration rounded to a frame: not worth a line
            return None
        which = ("cut short, or a wrong duration in its header" if self.header_frames > self.num_frames
                 else "a wrong duration in its header")
        return (f"{self.path}: the header says {self.header_frames} frames but the file holds {self.num_frames} "
                f"({which}); using {self.num_frames}")


def several_streams_note(info: VideoInfo) -> str | None:
    """The warning for a file with more than one video stream: which one is read, and why."""
    streams = info.video_streams
    if len(streams) < 2:
        return None
    largest = max(range(len(streams)), key=lambda i: streams[i][0] * streams[i][1])
    listed = ", ".join(f"#{i} {w}x{h} ({n} frames)" for i, (w, h, n) in enumerate(streams))
    return (f"{info.path}: {len(streams)} video streams ({listed}); both decoders read #0, the first (OpenCV's FFmpeg "
            f"backend reads no other)" + (f"; FFmpeg's tools would pick #{largest}, the largest: extract it with "
                                          f"ffmpeg -i in.mp4 -map 0:v:{largest} -c copy out.mp4" if largest else ""))


@dataclass(frozen=True)
class _PyAVHeader:
    """What PyAV reads of a file in one pass over its packets (demuxed; decoded only up to the first frame)."""
    streams: list  # [width, height, frames] of each video stream, from the container's header
    first_size: tuple[int, int] | None  # the first stream's first decoded frame's (height, width), as stored
    orientation: Orientation | None  # from that frame's display matrix: none if it has none, None if not right-angled
    whole_packets: int  # before the first one the demuxer marks corrupt (a file cut inside a frame ends in a
    #                     partial packet, which decoders would conceal, each its own way)
    rate: float | None
    header_frames: int  # the frame count the header states (0 where it states none: MKV, WebM)


def _read_pyav_header(path: str) -> _PyAVHeader:
    """The first video stream's _PyAVHeader; PyAV's own errors (av.FFmpegError) pass through."""
    import av  # lazy: PyAV is optional at run time (the opencv decoder works without it)
    with av.open(path) as container:
        stream = container.streams.video[0]
        streams, rate, header_frames = _stream_list(container), stream.guessed_rate or stream.average_rate, \
            int(stream.frames)
        first, whole = None, 0
        for packet in container.demux(stream):
            if packet.is_corrupt:
                break
            whole += packet.size > 0
            if first is None:
                first = next(iter(packet.decode()), None)
        if first is None:  # a decoder that holds every frame back until the end: flushed
            first = next(iter(stream.decode(None)), None)
    return _PyAVHeader(streams, None if first is None else (first.height, first.width), _orientation_of_frame(first),
                       whole, float(rate) if rate else None, header_frames)


def _pyav_header(path: str) -> _PyAVHeader | None:
    """What PyAV tells of a file OpenCV opened; None where PyAV is missing or cannot read it."""
    if importlib.util.find_spec("av") is None:
        return None
    try:
        return _read_pyav_header(path)
    except Exception:  # PyAV cannot read what OpenCV could: the stream list and the orientation stay unknown
        return None


def _orientation_of_frame(frame) -> Orientation | None:
    if frame is None:
        return None
    matrix = next((bytes(data) for data in frame.side_data if data.type.name == "DISPLAYMATRIX"), None)
    return NONE if matrix is None else Orientation.of_matrix_bytes(matrix)


def _stream_list(container) -> list:
    return [[s.codec_context.width, s.codec_context.height, int(s.frames)] for s in container.streams.video]


def _fourcc(cap: cv2.VideoCapture) -> str:
    code = int(cap.get(cv2.CAP_PROP_FOURCC))
    text = "".join(chr((code >> (8 * i)) & 0xFF) for i in range(4)).strip("\x00 ")
    return text if text.isprintable() and text else f"0x{code:08x}"


def _open_capture(path: str, threads: int | None) -> cv2.VideoCapture:
    """An OpenCV capture that returns frames as stored: the display orientation is applied by
    ``datasets.orientation`` for both decoders alike (OpenCV's own applies a mirrored matrix as a rotation)."""
    params = [cv2.CAP_PROP_N_THREADS, threads] if threads and hasattr(cv2, "CAP_PROP_N_THREADS") else []
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, params)
    if cap.isOpened():
        cap.set(cv2.CAP_PROP_ORIENTATION_AUTO, 0)  # not accepted among open()'s parameters
    return cap


def probe(path: str, decoder: str = "opencv") -> VideoInfo:
    """Frame count, fps, size and codec from the container, plus one decoded frame to prove the codec works.
    With ``decoder`` pyav, a codec that OpenCV's FFmpeg build cannot decode but PyAV can is accepted."""
    if not os.path.exists(path):
        raise VideoReadError(f"{path}: file not found; check the path in the manifest (relative paths are resolved "
                             f"against the manifest's folder)")
    if os.path.getsize(path) == 0:
        raise VideoReadError(f"{path}: empty file (0 bytes)")
    cap = _open_capture(path, threads=1)
    try:
        if not cap.isOpened():
            raise VideoReadError(f"{path}: OpenCV cannot open this file as a video (not a video, or truncated "
                                 f"before its header ends); check it with ffprobe, {REENCODE_HINT}, or remove it "
                                 f"from the manifest")
        count = int(round(cap.get(cv2.CAP_PROP_FRAME_COUNT)))
        fps = float(cap.get(cv2.CAP_PROP_FPS))
        codec = _fourcc(cap)
        if count <= 0:
            raise VideoReadError(f"{path}: the container reports no frames ({codec}); {REENCODE_HINT}")
        ok, frame = cap.read()
        if not ok or frame is None:
            if decoder in ("pyav", "auto"):
                return _probe_with_pyav(path, codec)
            raise VideoReadError(f"{path}: OpenCV opens this file but cannot decode its '{codec}' video "
                                 f"(its FFmpeg build lacks a decoder); {REENCODE_HINT}, or set data.decoder: "
                                 f"pyav if PyAV decodes it")
        header = _pyav_header(path)
        orientation = header.orientation if header else None
        if orientation is None or (orientation == NONE and cap.get(cv2.CAP_PROP_ORIENTATION_META) % 360):
            orientation = Orientation.of_rotation(cap.get(cv2.CAP_PROP_ORIENTATION_META))  # no PyAV: no mirror
        height, width = orientation.displayed(frame.shape[:2])
        regular, packets = _scan_packets(path)
        if header and header.whole_packets:
            packets = min(packets, header.whole_packets)
        return VideoInfo(path, packets or count, fps if fps > 0 else 25.0, width, height, codec, regular,
                         header.streams if header else [], orientation=orientation.name, header_frames=count)
    finally:
        cap.release()


def _probe_with_pyav(path: str, codec: str) -> VideoInfo:
    """The probe of a file only PyAV decodes: its first video stream's header, and one decoded frame."""
    import av  # lazy: PyAV is optional at run time (the opencv decoder works without it)
    try:
        header = _read_pyav_header(path)
    except av.FFmpegError as e:
        raise VideoReadError(f"{path}: neither OpenCV nor PyAV decodes its '{codec}' video ({e}); {REENCODE_HINT}")
    count = header.whole_packets  # the frames the file holds
    if header.first_size is None or not header.rate or count <= 0:
        raise VideoReadError(f"{path}: PyAV finds no decodable frame, frame rate or frame count in its '{codec}' "
                             f"video; {REENCODE_HINT}")
    orientation = header.orientation or NONE
    height, width = orientation.displayed(header.first_size)
    return VideoInfo(path, count, header.rate, width, height, codec, _scan_packets(path)[0], header.streams,
                     opencv_decodes=False, orientation=orientation.name, header_frames=header.header_frames or count)


def _scan_packets(path: str) -> tuple[bool, int]:
    """(whether the frames' timestamps, in presentation order, step by one frame duration each; the number of
    packets, i.e. of frames the file holds, whatever its header says).

    A seek finds a frame by its timestamp, a sequential decode counts frames: the two agree only if no
    frame is missing from the timeline (dropped frames, variable frame rate). Reads the packets without
    decoding them (OpenCV's raw mode): 30,000 packets in about 0.1 s. A file cut short ends its packets where
    its data ends, and one whose header under- or over-states the duration (an MKV written wrong) has as many
    packets as frames.
    """
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    try:
        times = []
        while cap.grab():
            times.append(cap.get(cv2.CAP_PROP_POS_MSEC))
    finally:
        cap.release()
    if len(times) < 3:
        return True, len(times)
    times = np.sort(np.asarray(times))
    steps = np.diff(times)
    step = float(np.median(steps))
    # a quarter of a frame allows timestamps rounded to milliseconds (30 fps in MKV: 33 and 34 ms steps)
    off_grid = np.flatnonzero(np.abs(steps - step) > 0.25 * step)
    if step > 0 and not len(off_grid):
        return True, len(times)
    if step > 0 and len(times) - (off_grid[0] + 1) <= _REORDER_DEPTH:
        # a gap among the last few timestamps only: a file cut inside a group of B-frames keeps a later frame's
        # packet without the frames shown before it; the frames end before the gap
        return True, int(off_grid[0]) + 1
    return False, len(times)


_REORDER_DEPTH = 16  # frames a decoder can hold back for reordering (H.264's largest DPB)


class StalledFile(VideoReadError):
    """A file that did not answer within data.sample_timeout_s (a stalled network mount, a corrupt stream)."""


class Prober:
    """``probe`` in a child process that can be stopped: a file on a stalled mount blocks inside FFmpeg, where no
    thread of ours can interrupt it, so the probe runs in a persistent spawned process (spawn: a fork of a process
    that used OpenCV's thread pool can deadlock) and one that does not answer in ``timeout`` seconds is killed,
    the file reported (StalledFile) and a fresh child started for the next one. ``timeout`` None: in process."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __call__(self, path: str, decoder: str) -> VideoInfo:
        if self.timeout is None:
            return probe(path, decoder)
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self._pool.submit(int).result()  # started and imported: the deadline below is the probe's alone
        future = self._pool.submit(probe, path, decoder)
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            self.close(kill=True)
            raise StalledFile(f"{path}: no answer within {self.timeout:g} s while reading its header "
                              f"(data.sample_timeout_s): a stalled mount or a corrupt file?") from None

    def close(self, kill: bool = False) -> None:
        if self._pool is not None:
            if kill:  # the child is blocked: it would never take a shutdown request
                for process in list(getattr(self._pool, "_processes", {}).values()):
                    process.kill()
            self._pool.shutdown(wait=not kill, cancel_futures=True)
            self._pool = None


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
            return probe(path, decoder)  # raises the clear error for a missing file
        entry = self.entries.get(key)
        if entry and entry.get("stamp") == stamp and entry["info"].keys() == VideoInfo.__dataclass_fields__.keys():
            info = VideoInfo(**entry["info"])
            if info.opencv_decodes or decoder in ("pyav", "auto"):
                return info
        info = (prober or probe)(path, decoder)
        self.entries[key] = {"stamp": stamp, "info": asdict(info)}
        self.dirty = True
        return info

    def save(self) -> None:
        if not (self.path and self.dirty):
            return
        atomic_write_bytes(self.path, json.dumps(self.entries).encode())
        self.dirty = False


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


_PYAV_UNRELIABLE: set[str] = set()  # PyAV timestamps found not to number frames one by one: OpenCV reads it
DECODERS = ("opencv", "pyav")  # the two exact decoders; data.decoder may also say auto (choose_decoder)
SEEK_MARGINS = (4, 32, 256)  # frames: where a seek landed after its frame, the next tries seek this much earlier


class _TimestampsUnreliable(Exception):
    """PyAV's timestamps of this file do not identify frames exactly; the OpenCV path takes over."""


class PyAVReader(VideoReader):
    """The same reads (same frames, same pixels) decoded with PyAV, for faster random clips.

    A clip far from the current position costs decoding from the keyframe before it. Two things make that
    cheaper than OpenCV here: the seek goes to the keyframe before the first needed frame (OpenCV's seek
    goes to the keyframe before ``frame - 16``, a whole GOP earlier for 16 frames of every GOP), and frames
    no read needs are not decoded when no other frame refers to them (``skip_frame=NONREF``, set packet by
    packet: with B-frames, about half of the frames between a keyframe and the clip, and the gaps of a
    strided clip). Frames are identified by their timestamps; every decoded frame is checked to lie on the
    frame-rate grid, in order, with no frame missing that was not skipped on purpose. A file that fails
    a check is read by the OpenCV path from then on (logged once): never a wrong frame in silence.

    Needs PyAV (``pip install av``): ``data.decoder: pyav``.
    """

    skip_unneeded_frames = True  # False: decode every frame (for comparisons)
    decoder = "pyav"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # lazy: PyAV is optional at run time; without it this fails here, at open, with a clear ImportError
        import av  # noqa: F401
        self._container = None
        self._frames = None  # iterator over the decoded frames from the current position
        self._wanted: frozenset[int] = frozenset()  # frames of the current read()
        self._skip_below = 0  # packets of frames below this that the read does not want may be skipped
        self._maybe_skipped: set[int] = set()  # frames sent with NONREF (the decoder drops the non-reference ones)
        self._last_out = -1  # index of the last decoded frame since the last seek

    def read(self, indices: Sequence[int]) -> np.ndarray:
        indices = [int(i) for i in indices]
        self._wanted = frozenset(indices)
        # frames after the read may be wanted by the next one: never skipped
        self._skip_below = max(indices, default=0) if self.skip_unneeded_frames else -1
        return super().read(indices)

    def close(self) -> None:
        super().close()
        if self._container is not None:
            self._container.close()
            self._container, self._frames = None, None

    def _read_one(self, index: int, dst: np.ndarray) -> bool:
        if self.path in _PYAV_UNRELIABLE or not self.info.regular_timestamps:
            self._opencv_must_decode("its frame timestamps do not number the frames one by one")
            return super()._read_one(index, dst)
        import av  # lazy: PyAV is optional at run time (imported by __init__ already)
        try:
            return self._decode_one(index, dst)
        except _TimestampsUnreliable as why:
            return self._read_with_opencv(str(why), index, dst)
        except av.FFmpegError:  # damaged data (a file cut short, a corrupt packet) while opening, seeking, decoding
            self.close()
            length = self._count_frames(index + 1)
            if length > index:  # decodable from the start, not after a seek
                return self._read_with_opencv(f"decoding after a seek to frame {index} fails", index, dst)
            return self._ended_at(index, length)

    def _read_with_opencv(self, why: str, index: int, dst: np.ndarray) -> bool:
        """PyAV cannot read this file frame-exactly: OpenCV's path reads it from now on (logged once)."""
        self._opencv_must_decode(why)
        _PYAV_UNRELIABLE.add(self.path)
        log.warning("%s: %s; reading this file with OpenCV from now on (exact, slower seeks)", self.path, why)
        self.close()
        return super()._read_one(index, dst)

    def _count_frames(self, limit: int) -> int:
        if self.path in _PYAV_UNRELIABLE or not self.info.regular_timestamps:
            return super()._count_frames(limit)
        import av  # lazy: PyAV is optional at run time (imported by __init__ already)
        length = 0
        try:
            with av.open(self.path) as container:
                for _ in container.decode(container.streams.video[0]):
                    length += 1
                    if length >= limit:
                        break
        except av.FFmpegError:  # the damaged part: the end, as far as decoding goes
            pass
        return length

    def _opencv_must_decode(self, why: str) -> None:
        """Before falling back to OpenCV's exact path: a file only PyAV decodes has none."""
        if not self.info.opencv_decodes:
            raise VideoReadError(f"{self.path}: {why}, so PyAV cannot read it frame-exactly, and OpenCV cannot "
                                 f"decode its '{self.info.codec}' video; {REENCODE_HINT}")

    def _decode_one(self, index: int, dst: np.ndarray) -> bool:
        if index not in self._wanted:  # e.g. the last frame, read for indices past the real end
            self._wanted = self._wanted | {index}
        if self._container is None:
            self._open()
        if index < self._next or index - self._next > self.seek_threshold:
            self._seek(index)
        for margin in (*SEEK_MARGINS, None):
            found = self._decode_until(index, dst)
            if found is not None:
                return found
            if margin is None:
                break
            # The seek found a keyframe after the frame: a container indexed by decode time (AVI) gives a keyframe
            # the decode time of the B-frames shown before it. Seek earlier, as OpenCV does (16 frames), but only
            # when needed.
            self._seek(index, margin)
        raise _TimestampsUnreliable(f"seeking to frame {index} landed after it, even from {SEEK_MARGINS[-1]} frames "
                                    f"earlier")

    def _decode_until(self, index: int, dst: np.ndarray) -> bool | None:
        """Decode up to frame ``index`` into ``dst``: True, False if the stream ended first, None if the first
        frame after a seek lies past it."""
        for frame in self._frames:
            got = self._frame_number(frame.pts)
            if got <= self._last_out:
                raise _TimestampsUnreliable(f"frame timestamps go backwards (frame {got} after {self._last_out})")
            if self._last_out >= 0 and not self._maybe_skipped.issuperset(range(self._last_out + 1, got)):
                raise _TimestampsUnreliable(f"frame timestamps jump from frame {self._last_out} to {got}")
            self._maybe_skipped.difference_update(range(self._last_out + 1, got + 1))
            self._last_out, self._next = got, got + 1
            if got < index:
                self.stats["grabbed"] += 1
                continue
            if got > index:  # only right after a seek: the keyframe found lies after the frame
                return None
            # what OpenCV's FFmpeg backend does, so both decoders give the same pixels: swscale to BGR with bicubic
            # chroma, then BGR -> RGB. Converting straight to RGB (bilinear) differed by up to 23 on 10-bit
            # H.264 (bicubic to RGB: 4); 8-bit 4:2:0 takes swscale's unscaled path either way.
            self._store(self._reformatter.reformat(frame, format="bgr24", interpolation="BICUBIC").to_ndarray(), dst)
            self.stats["decoded"] += 1
            return True
        return self._ended_at(index)

    def _open(self) -> None:
        import av  # lazy: PyAV is optional at run time (the opencv decoder works without it)
        from av.video.reformatter import VideoReformatter  # (the same)
        try:
            self._container = av.open(self.path)
        except (av.FFmpegError, OSError) as e:
            raise VideoReadError(f"{self.path}: PyAV can no longer open this file (moved or truncated?): {e}")
        self._stream = self._container.streams.video[0]
        # one converter for the file: frame.to_ndarray() builds a new one (a new swscale context) every frame,
        # measured 0.8 ms a frame at 640x360, more than the decode
        self._reformatter = VideoReformatter()
        if self.threads == 1:
            self._stream.thread_type, self._stream.codec_context.thread_count = "SLICE", 1
        else:  # None: FFmpeg's choice (frame and slice threads on every core)
            self._stream.thread_type, self._stream.codec_context.thread_count = "AUTO", self.threads or 0
        rate = self._stream.guessed_rate or self._stream.average_rate
        if not rate:
            raise _TimestampsUnreliable("the stream has no frame rate")
        self._frames_per_tick = float(rate * self._stream.time_base)
        self._origin = None  # no skipping until frame 0's timestamp is known
        self._frames = self._decode()
        first = next(self._frames, None)
        if first is None or first.pts is None:
            raise _TimestampsUnreliable("the first frame has no timestamp")
        self._origin = first.pts  # frame 0, as OpenCV counts (its first_frame_number)
        self._frames = itertools.chain([first], self._frames)
        self._next, self._last_out = 0, -1
        self._maybe_skipped.clear()

    def _seek(self, index: int, margin: int = 0) -> None:
        """To the keyframe before frame ``index - margin``."""
        target = self._origin + round(max(0, index - margin) / self._frames_per_tick)
        self._container.seek(target, stream=self._stream, backward=True, any_frame=False)  # flushes the decoder
        self._frames = self._decode()
        self._next, self._last_out = index, -1
        self._maybe_skipped.clear()
        self.stats["seeks"] += 1

    def _frame_number(self, pts: int | None) -> int:
        if pts is None:
            raise _TimestampsUnreliable("a frame has no timestamp")
        position = (pts - self._origin) * self._frames_per_tick
        number = round(position)
        if abs(position - number) > 0.25:
            raise _TimestampsUnreliable(f"frame timestamps are off the frame-rate grid (frame {position:.2f})")
        return number

    def _decode(self):
        """Decoded frames from the current position; packets of frames nobody wants go in as NONREF."""
        context = self._stream.codec_context
        skipping = False
        for packet in self._container.demux(self._stream):
            skip = False
            if packet.pts is not None and self._origin is not None:
                number = round((packet.pts - self._origin) * self._frames_per_tick)
                skip = number < self._skip_below and number not in self._wanted
                if skip:
                    self._maybe_skipped.add(number)
            if skip != skipping:
                context.skip_frame, skipping = ("NONREF" if skip else "DEFAULT"), skip
            yield from context.decode(packet)
        context.skip_frame = "DEFAULT"


# Codec families by the FourCC OpenCV reports (the probe's VideoInfo.codec)
_CODEC_FAMILIES = {"h264": ("h264", "avc1", "avc3", "x264", "davc"), "hevc": ("hevc", "hev1", "hvc1", "h265"),
                   "mpeg4": ("fmp4", "xvid", "divx", "dx50", "mp4v"), "vp9": ("vp90", "vp09"), "vp8": ("vp80",)}
# data.decoder: auto, from bench/loader.py --part codecs (2-core CPU, one decoder thread, 2026-11-22; pyav's
# frames/s over opencv's, random 16-frame clips / 64-frame windows): random reads go to PyAV, whose seek to the
# right keyframe and skipped non-reference frames win on H.264 (360p 1.59x / 1.30x, 720p 1.51x / 1.48x), H.265
# (1.43x / 1.27x), MPEG-4 Part 2 in AVI with its 12-frame GOPs (2.36x / 1.38x: OpenCV's seek goes a whole GOP
# back) and VP9 (1.02x / 1.05x). A sequential pass goes to OpenCV: pyav was 0.89-1.16x of it, and faster in both
# runs only on 720p H.264 (1.07x, 1.16x), slower on MPEG-4 (0.94x, 0.89x). Codecs not measured keep OpenCV.
AUTO_DECODER = {"random": {"h264": "pyav", "hevc": "pyav", "mpeg4": "pyav", "vp9": "pyav"}, "sequential": {}}


def codec_family(info: VideoInfo) -> str:
    code = info.codec.lower()
    return next((family for family, codes in _CODEC_FAMILIES.items() if code in codes), code)


def choose_decoder(decoder: str, info: VideoInfo, access: str = "random") -> str:
    """``data.decoder`` for this file: auto picks the faster exact decoder for its codec and the access pattern
    (AUTO_DECODER); a codec only PyAV decodes (AV1 in OpenCV's wheel) goes to PyAV whatever was asked."""
    if decoder != "auto":
        return decoder
    if not info.opencv_decodes:
        return "pyav"
    choice = AUTO_DECODER[access].get(codec_family(info), "opencv")
    return choice if choice == "opencv" or importlib.util.find_spec("av") is not None else "opencv"


def open_reader(path: str, size: Sequence[int] | None = None, threads: int | None = None,
                info: VideoInfo | None = None, decoder: str = "opencv", access: str = "random",
                autorotate: bool = True) -> VideoReader:
    """The reader of ``data.decoder``: ``opencv`` (VideoReader), ``pyav`` (PyAVReader), or ``auto`` (the faster
    of the two for the file's codec and ``access``: random clips or a sequential pass). Either gives the same
    pixels, turned as displayed unless ``autorotate`` is False (data.autorotate)."""
    if decoder not in ("auto", *DECODERS):
        raise ValueError(f"unknown decoder {decoder!r}; choose one of auto, {', '.join(DECODERS)}")
    if decoder == "auto":
        info = info or probe(path, "auto")
        decoder = choose_decoder(decoder, info, access)
    return (PyAVReader if decoder == "pyav" else VideoReader)(path, size, threads=threads, info=info,
                                                              autorotate=autorotate)


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


# Readers a forked process inherited from its parent: never used (an OpenCV capture shares its file offset with
# the parent's, so both read wrong frames and see false ends; PyAV's decoder threads do not exist in the child
# and its swscale pool hangs), and never closed (closing runs the same libraries' teardown on the copied state).
_FORKED_READERS: list = []


class ReaderCache:
    """The last few open readers of a process (a DataLoader worker reads consecutive windows of a video)."""

    def __init__(self, capacity: int = 4, threads: int | None = 1):
        self.capacity, self.threads = capacity, threads
        self._readers: OrderedDict = OrderedDict()
        self._pid = os.getpid()

    def get(self, path: str, size, info: VideoInfo | None = None, decoder: str = "opencv",
            autorotate: bool = True) -> VideoReader:
        if os.getpid() != self._pid:  # a forked DataLoader worker: the parent's readers are not ours (_FORKED_READERS)
            _FORKED_READERS.extend(self._readers.values())
            self._readers.clear()
            self._pid = os.getpid()
        key = (path, None if size is None else tuple(size), decoder, autorotate)
        reader = self._readers.pop(key, None)
        if reader is None:
            reader = open_reader(path, size, threads=self.threads, info=info, decoder=decoder, autorotate=autorotate)
            while len(self._readers) >= self.capacity:
                self._readers.popitem(last=False)[1].close()
        self._readers[key] = reader
        return reader

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
