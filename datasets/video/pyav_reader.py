"""The same frame-exact reads decoded with PyAV (``data.decoder: pyav``), faster for random clips; a file PyAV cannot
read frame-exactly goes to the OpenCV path."""

from __future__ import annotations

import itertools
import logging
from typing import Sequence

import numpy as np

from datasets.video.frame_reader import FrameReader
from datasets.video.info import REENCODE_HINT, VideoReadError
from datasets.video.opencv_reader import OpenCVReader

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger

_PYAV_UNRELIABLE: set[str] = set()  # PyAV timestamps found not to number frames one by one: OpenCV reads it
SEEK_MARGINS = (4, 32, 256)  # frames: where a seek landed after its frame, the next tries seek this much earlier


class _TimestampsUnreliable(Exception):
    """PyAV's timestamps of this file do not identify frames exactly; the OpenCV path takes over."""


class PyAVReader(FrameReader):
    """The same reads (same frames, same pixels) decoded with PyAV, for faster random clips.

    A clip far from the current position costs decoding from the keyframe before it. Two things make that
    cheaper than OpenCV here: the seek goes to the keyframe before the first needed frame (OpenCV's seek
    goes to the keyframe before ``frame - 16``, a whole GOP earlier for 16 frames of every GOP), and frames
    no read needs are not decoded when no other frame refers to them (``skip_frame=NONREF``, set packet by
    packet: with B-frames, about half of the frames between a keyframe and the clip, and the gaps of a
    strided clip). Frames are identified by their timestamps; every decoded frame is checked to lie on the
    frame-rate grid, in order, with no frame missing that was not skipped on purpose. A file that fails
    a check is read by the OpenCV path from then on (logged once): never a wrong frame in silence. That path is
    an ``OpenCVReader`` of the same file, size and orientation this reader holds and hands the frame to.

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
        self._opencv: OpenCVReader | None = None  # the fallback, opened when first needed

    def read(self, indices: Sequence[int]) -> np.ndarray:
        indices = [int(i) for i in indices]
        self._wanted = frozenset(indices)
        # frames after the read may be wanted by the next one: never skipped
        self._skip_below = max(indices, default=0) if self.skip_unneeded_frames else -1
        return super().read(indices)

    def close(self) -> None:
        if self._opencv is not None:
            self._opencv.close()
        if self._container is not None:
            self._container.close()
            self._container, self._frames = None, None

    @property
    def seeks_exactly(self) -> bool:
        """PyAV's seeks and timestamps read this file frame-exactly (else the OpenCV reader reads it)."""
        return self.path not in _PYAV_UNRELIABLE and self.info.regular_timestamps

    def _read_one(self, index: int, dst: np.ndarray) -> bool:
        if self.path in _PYAV_UNRELIABLE or not self.info.regular_timestamps:
            self._opencv_must_decode("its frame timestamps do not number the frames one by one")
            return self._opencv_reads(index, dst)
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
        return self._opencv_reads(index, dst)

    def _fallback(self) -> OpenCVReader:
        """The OpenCV reader of this file (same size, orientation, pixels), opened when first needed; its
        statistics are this reader's."""
        if self._opencv is None:
            self._opencv = OpenCVReader(
                self.path, self.size, self.threads, self.info, self.seek_threshold, self.autorotate
            )
            self._opencv.stats = self.stats
        return self._opencv

    def _opencv_reads(self, index: int, dst: np.ndarray) -> bool:
        """Frame ``index`` read by the fallback, which shares this reader's frame count."""
        fallback = self._fallback()
        fallback.num_frames = self.num_frames
        found = fallback._read_one(index, dst)
        self.num_frames = fallback.num_frames  # lowered if the file ended before index
        return found

    def _count_frames(self, limit: int) -> int:
        if self.path in _PYAV_UNRELIABLE or not self.info.regular_timestamps:
            return self._fallback()._count_frames(limit)
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
            raise VideoReadError(
                f"{self.path}: {why}, so PyAV cannot read it frame-exactly, and OpenCV cannot "
                f"decode its '{self.info.codec}' video; {REENCODE_HINT}"
            )

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
        raise _TimestampsUnreliable(
            f"seeking to frame {index} landed after it, even from {SEEK_MARGINS[-1]} frames earlier"
        )

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
