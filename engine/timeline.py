"""Timelines: a video's per-chunk predictions merged into segments, and their agreement with an annotated timeline."""
from __future__ import annotations

import numpy as np

from datasets.manifest import VideoRecord


def merge_segments(timeline: list[dict], num_frames: int) -> list[dict]:
    """Contiguous chunks with the same top label merged; overlapping chunks split at the overlap's middle."""
    segments: list[dict] = []
    for i, window in enumerate(timeline):
        start = 0 if i == 0 else (timeline[i - 1]["end"] + window["start"]) // 2
        start = max(start, segments[-1]["end"] if segments else 0)
        end = num_frames if i == len(timeline) - 1 else (window["end"] + timeline[i + 1]["start"]) // 2
        if end <= start:
            continue
        if segments and segments[-1]["label"] == window["label"]:
            segments[-1]["end"] = end
        else:
            segments.append({"start": start, "end": end, "label": window["label"]})
    return segments


def timeline_agreement(segments: list[dict], record: VideoRecord, fps: float, num_frames: int) -> float:
    """Share of the annotated frames whose merged predicted segment has the annotated label."""
    predicted = np.empty(num_frames, dtype=object)
    for seg in segments:
        predicted[seg["start"]:seg["end"]] = seg["label"]
    hits = total = 0
    for seg in record.segments:
        start, end = seg.in_frames(fps)
        end = min(end, num_frames)
        hits += int(np.sum(predicted[start:end] == seg.label))
        total += max(end - start, 0)
    return round(hits / max(total, 1), 4)
