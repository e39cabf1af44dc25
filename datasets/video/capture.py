"""OpenCV's capture of a file, opened one way for every path of the project."""

from __future__ import annotations

import importlib.util
import os

import cv2
import numpy as np


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


def fourcc(cap: cv2.VideoCapture) -> str:
    code = int(cap.get(cv2.CAP_PROP_FOURCC))
    text = "".join(chr((code >> (8 * i)) & 0xFF) for i in range(4)).strip("\x00 ")
    return text if text.isprintable() and text else f"0x{code:08x}"


def open_capture(path: str, threads: int | None) -> cv2.VideoCapture:
    """An OpenCV capture that returns frames as stored: the display orientation is applied by
    ``datasets.orientation`` for both decoders alike (OpenCV's own applies a mirrored matrix as a rotation)."""
    params = [cv2.CAP_PROP_N_THREADS, threads] if threads and hasattr(cv2, "CAP_PROP_N_THREADS") else []
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, params)
    if cap.isOpened():
        cap.set(cv2.CAP_PROP_ORIENTATION_AUTO, 0)  # not accepted among open()'s parameters
    return cap


def decode_sequentially(path: str, index: int) -> np.ndarray | None:
    cap = open_capture(path, threads=None)
    try:
        for _ in range(index):
            if not cap.grab():
                return None
        ok, frame = cap.read()
        return frame if ok else None
    finally:
        cap.release()
