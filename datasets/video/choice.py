"""``data.decoder``: which exact decoder reads a file (``auto`` picks by codec and access pattern), and the reader
that does."""

from __future__ import annotations

import importlib.util
from typing import Sequence

from datasets.video.frame_reader import FrameReader
from datasets.video.info import VideoInfo
from datasets.video.opencv_reader import OpenCVReader
from datasets.video.probe import probe
from datasets.video.pyav_reader import PyAVReader

DECODERS = ("opencv", "pyav")  # the two exact decoders; data.decoder may also say auto (choose_decoder)
# Codec families by the FourCC OpenCV reports (the probe's VideoInfo.codec)
_CODEC_FAMILIES = {
    "h264": ("h264", "avc1", "avc3", "x264", "davc"),
    "hevc": ("hevc", "hev1", "hvc1", "h265"),
    "mpeg4": ("fmp4", "xvid", "divx", "dx50", "mp4v"),
    "vp9": ("vp90", "vp09"),
    "vp8": ("vp80",),
}
# data.decoder: auto: random reads go to PyAV, whose seek lands on the keyframe before the frame asked for and
# skips non-reference frames (OpenCV's decodes from a whole GOP back); a sequential pass goes to OpenCV. A codec
# python -m bench.loader --part codecs has not compared keeps OpenCV.
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


def open_reader(
    path: str,
    size: Sequence[int] | None = None,
    threads: int | None = None,
    info: VideoInfo | None = None,
    decoder: str = "opencv",
    access: str = "random",
    autorotate: bool = True,
) -> FrameReader:
    """The reader of ``data.decoder``: ``opencv`` (OpenCVReader), ``pyav`` (PyAVReader), or ``auto`` (the faster
    of the two for the file's codec and ``access``: random clips or a sequential pass). Either gives the same
    pixels, turned as displayed unless ``autorotate`` is False."""
    if decoder not in ("auto", *DECODERS):
        raise ValueError(f"unknown decoder {decoder!r}; choose one of auto, {', '.join(DECODERS)}")
    if decoder == "auto":
        info = info or probe(path, "auto")
        decoder = choose_decoder(decoder, info, access)
    return (PyAVReader if decoder == "pyav" else OpenCVReader)(
        path, size, threads=threads, info=info, autorotate=autorotate
    )
