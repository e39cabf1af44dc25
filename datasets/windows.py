"""Window arithmetic: sample windows, clip placement, inference chunks. A window is a frame range [start, end)."""

from __future__ import annotations

import math

import numpy as np


def split_into_windows(
    length: int, size: int | None, overlap: int = 0, align_last_to_end: bool = False
) -> list[tuple[int, int]]:
    """Windows of ``size`` frames, consecutive ones sharing ``overlap`` frames, covering [0, length).

    The last window either ends at ``length`` with its own start (align_last_to_end=True: every window is
    full length, the inference-chunk rule) or keeps the stride and is shorter (the sample-window rule).
    size None or <= 0, or size >= length: one window.
    """
    if length <= 0:
        return []
    if size is None or size <= 0 or size >= length:
        return [(0, length)]
    if not 0 <= overlap < size:
        raise ValueError(f"overlap {overlap} must be in [0, {size})")
    stride = size - overlap
    count = 1 + math.ceil((length - size) / stride)
    starts = [i * stride for i in range(count)]
    if align_last_to_end:
        return [(min(s, length - size), min(s, length - size) + size) for s in starts]
    return [(s, min(s + size, length)) for s in starts]


def chunk_windows(length: int, chunk_size: int, overlap: int = 0) -> list[tuple[int, int]]:
    """The chunks of a clip of ``length`` frames: one window [0, length) when ``chunk_size`` is -1 or >= length."""
    if chunk_size == -1 or chunk_size >= length:
        return [(0, length)]
    return split_into_windows(length, chunk_size, overlap, align_last_to_end=True)


def inference_windows(length: int, chunk_size: int, overlap: int, aggregation: str) -> list[tuple[int, int]]:
    windows = chunk_windows(length, chunk_size, overlap)
    return windows[-1:] if aggregation == "last" else windows


def clip_indices(
    start: int,
    end: int,
    num_frames: int,
    stride: int,
    rng: np.random.Generator | None,
    test_clip: int = 0,
    test_clips: int = 1,
) -> np.ndarray:
    """Frame indices of one clip inside the window [start, end).

    ``num_frames`` frames ``stride`` apart, at a random place (rng given: training) or, at evaluation (rng
    None), test clip ``test_clip`` of ``test_clips`` evenly spaced ones: the first at the window's start and the last
    at its end (one: centred), as the published multi-clip test protocols place them. A window too short for that span
    gets ``num_frames`` indices spread evenly over it (frames repeat when the window has fewer frames than the
    clip), whatever the test clip. num_frames -1: the whole window at ``stride``.
    """
    length = end - start
    if num_frames == -1:
        return np.arange(start, end, stride)
    span = (num_frames - 1) * stride + 1
    if span <= length:
        if rng is not None:
            offset = int(rng.integers(0, length - span + 1))
        elif test_clips > 1:
            offset = round(test_clip * (length - span) / (test_clips - 1))
        else:
            offset = (length - span) // 2
        return start + offset + stride * np.arange(num_frames)
    return start + np.floor(np.linspace(0, length, num_frames, endpoint=False)).astype(np.int64)


def video_stride(frame_stride: int, fps: float | None, video_fps: float | None) -> int:
    """Video frames between a clip's frames: ``frame_stride`` (data.frame_stride); with data.fps (``fps``), the
    video's own rate over it, rounded (at least 1), so videos of any frame rate give clips of the same span of
    time."""
    if fps is None or not video_fps:
        return frame_stride
    return max(1, round(video_fps / fps))
