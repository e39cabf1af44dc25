"""A video's header read (``probe``): frame count, rate, displayed size, codec, streams, orientation, whether its
timestamps allow frame-exact seeks; checked against the file's packets, since headers misstate lengths."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import cv2
import numpy as np

from datasets.orientation import NONE, Orientation
from datasets.video import capture
from datasets.video.info import REENCODE_HINT, VideoInfo, VideoReadError


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
        streams, rate, header_frames = (
            _stream_list(container),
            stream.guessed_rate or stream.average_rate,
            int(stream.frames),
        )
        first, whole = None, 0
        for packet in container.demux(stream):
            if packet.is_corrupt:
                break
            whole += packet.size > 0
            if first is None:
                first = next(iter(packet.decode()), None)
        if first is None:  # a decoder that holds every frame back until the end: flushed
            first = next(iter(stream.decode(None)), None)
    return _PyAVHeader(
        streams,
        None if first is None else (first.height, first.width),
        _orientation_of_frame(first),
        whole,
        float(rate) if rate else None,
        header_frames,
    )


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


def probe(path: str, decoder: str = "opencv") -> VideoInfo:
    """Frame count, fps, size and codec from the container, plus one decoded frame to prove the codec works.
    With ``decoder`` pyav, a codec that OpenCV's FFmpeg build cannot decode but PyAV can is accepted."""
    if not os.path.exists(path):
        raise VideoReadError(
            f"{path}: file not found; check the path in the manifest (relative paths are resolved "
            f"against the manifest's folder)"
        )
    if os.path.getsize(path) == 0:
        raise VideoReadError(f"{path}: empty file (0 bytes)")
    cap = capture.open_capture(path, threads=1)
    try:
        if not cap.isOpened():
            raise VideoReadError(
                f"{path}: OpenCV cannot open this file as a video (not a video, or truncated "
                f"before its header ends); check it with ffprobe, {REENCODE_HINT}, or remove it "
                f"from the manifest"
            )
        count = int(round(cap.get(cv2.CAP_PROP_FRAME_COUNT)))
        fps = float(cap.get(cv2.CAP_PROP_FPS))
        codec = capture.fourcc(cap)
        if count <= 0:
            raise VideoReadError(f"{path}: the container reports no frames ({codec}); {REENCODE_HINT}")
        ok, frame = cap.read()
        if not ok or frame is None:
            if decoder in ("pyav", "auto"):
                return _probe_with_pyav(path, codec)
            raise VideoReadError(
                f"{path}: OpenCV opens this file but cannot decode its '{codec}' video "
                f"(its FFmpeg build lacks a decoder); {REENCODE_HINT}, or set data.decoder: "
                f"pyav if PyAV decodes it"
            )
        header = _pyav_header(path)
        orientation = header.orientation if header else None
        if orientation is None or (orientation == NONE and cap.get(cv2.CAP_PROP_ORIENTATION_META) % 360):
            orientation = Orientation.of_rotation(cap.get(cv2.CAP_PROP_ORIENTATION_META))  # no PyAV: no mirror
        height, width = orientation.displayed(frame.shape[:2])
        regular, packets = _scan_packets(path)
        if header and header.whole_packets:
            packets = min(packets, header.whole_packets)
        return VideoInfo(
            path,
            packets or count,
            fps if fps > 0 else 25.0,
            width,
            height,
            codec,
            regular,
            header.streams if header else [],
            orientation=orientation.name,
            header_frames=count,
        )
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
        raise VideoReadError(
            f"{path}: PyAV finds no decodable frame, frame rate or frame count in its '{codec}' video; {REENCODE_HINT}"
        )
    orientation = header.orientation or NONE
    height, width = orientation.displayed(header.first_size)
    return VideoInfo(
        path,
        count,
        header.rate,
        width,
        height,
        codec,
        _scan_packets(path)[0],
        header.streams,
        opencv_decodes=False,
        orientation=orientation.name,
        header_frames=header.header_frames or count,
    )


def _scan_packets(path: str) -> tuple[bool, int]:
    """(whether the frames' timestamps, in presentation order, step by one frame duration each; the number of
    packets, i.e. of frames the file holds, whatever its header says).

    A seek finds a frame by its timestamp, a sequential decode counts frames: the two agree only if no
    frame is missing from the timeline (dropped frames, variable frame rate). Reads the packets without
    decoding them (OpenCV's raw mode): 30,000 packets in about 0.1 s. A file cut short ends its packets where
    its data ends, and one whose header under- or over-states the duration (an MKV written wrong) has as many
    packets as frames.
    """
    times = frame_times(path) * 1000.0
    if len(times) < 3:
        return True, len(times)
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


def frame_times(path: str) -> np.ndarray:
    """The presentation time of each packet of the file's first video stream, in seconds, sorted: frame i's time
    (read without decoding, OpenCV's raw mode)."""
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_FORMAT, -1])
    try:
        times = []
        while cap.grab():
            times.append(cap.get(cv2.CAP_PROP_POS_MSEC))
    finally:
        cap.release()
    return np.sort(np.asarray(times, dtype=np.float64)) / 1000.0


_REORDER_DEPTH = 16  # frames a decoder can hold back for reordering (H.264's largest DPB)
