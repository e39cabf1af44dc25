"""Timelines: a video's chunk predictions blended into per-frame class probabilities, per-frame labels, segments,
and their scores against an annotated timeline (engine.metrics.segments).

Each frame's probabilities come from every chunk that covers it, weighted by how near the chunk's centre the frame
lies (a triangle that is highest at the centre, never zero): inside an overlap the nearer chunk counts more, so a
boundary between two chunks that disagree falls at the frame where their weighted confidences cross, not at a
chunk's edge. The resolution is the chunk step (chunk - overlap): the backbones here pool time into one feature
vector per chunk, so nothing finer exists to blend.
"""

from __future__ import annotations

import numpy as np

from datasets.records import label_runs

EDGE_WEIGHT = 0.05  # a chunk's weight at its edges, against 1 at its centre: frames covered once keep its label


def frame_probabilities(chunk_probs: np.ndarray, windows: np.ndarray, num_frames: int) -> np.ndarray:
    """[num_frames, K] per-frame class probabilities from chunk probabilities [n, K] at ``windows`` [n, 2] (each
    chunk's [start, end) in the frames of the result). Frames between two chunks (a frame stride leaves up to
    stride - 1 of them) and after the last take the nearest chunk's; every row sums to 1."""
    chunk_probs = np.asarray(chunk_probs, dtype=np.float64)
    windows = np.asarray(windows, dtype=np.int64).reshape(-1, 2)
    if len(windows) != len(chunk_probs):
        raise ValueError(f"{len(chunk_probs)} chunk predictions for {len(windows)} windows")
    total = np.zeros((num_frames, chunk_probs.shape[1]))
    weight = np.zeros(num_frames)
    for i, ((start, end), probs) in enumerate(zip(windows, chunk_probs)):
        # cover the gap to the next chunk's start (or to the video's end after the last)
        reach = num_frames if i + 1 == len(windows) else max(end, int(windows[i + 1][0]))
        start, reach = max(int(start), 0), min(reach, num_frames)
        if reach <= start:
            continue
        frames = np.arange(start, reach)
        half = max((end - start) / 2, 0.5)
        w = np.clip(1 - np.abs(frames + 0.5 - (start + end) / 2) / half, EDGE_WEIGHT, 1.0)
        total[start:reach] += w[:, None] * probs
        weight[start:reach] += w
    covered = weight > 0
    if not covered.all():  # before the first chunk (it starts at 0 in practice): the first chunk's
        first = int(np.argmax(covered)) if covered.any() else 0
        total[:first], weight[:first] = chunk_probs[0], 1.0
    return total / weight[:, None]


def segments_of_frames(labels: np.ndarray, fps: float, class_names: list[str] | None = None) -> list[dict]:
    """Per-frame class indices -> [{"start", "end", "start_sec", "end_sec", "label"}] runs (end exclusive),
    labelled with ``class_names`` where given; frames labelled -1 (not annotated) form no segment."""
    return [
        {
            "start": start,
            "end": end,
            "start_sec": round(start / fps, 3),
            "end_sec": round(end / fps, 3),
            "label": class_names[label] if class_names is not None else label,
        }
        for start, end, label in label_runs(labels)
        if label >= 0
    ]


def annotated(predicted: np.ndarray, truth: np.ndarray) -> tuple[list[int], list[int]]:
    """The frames an annotation covers (truth >= 0) of both sequences, as lists of Python ints: what a timeline is
    scored on (and plain values for checkpoints and JSON)."""
    keep = np.asarray(truth) >= 0
    return np.asarray(predicted)[keep].tolist(), np.asarray(truth)[keep].tolist()
