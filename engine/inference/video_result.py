"""One video's result from streaming inference (``stream.classify_video``): what infer_chunked.py prints,
writes as a JSON line (``to_json``), draws and stores as features. The per-frame timeline and the chunk features
are arrays for the files that hold them (``OUTPUT_frames.csv``, ``--plot``, ``--features``), never JSON."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class FrameTimeline:
    """A video's per-frame timeline: each frame's predicted class index and its probability, and the annotated
    class index (-1 where no segment is; None without segments)."""

    labels: np.ndarray
    probability: np.ndarray
    truth: np.ndarray | None


@dataclass(frozen=True)
class ChunkFeatures:
    """What ``--features`` stores of a video (features.py): each inference chunk's backbone features after view
    fusion, its logits (with a temporal head: the head's per-chunk outputs) and its frames."""

    features: np.ndarray  # [n, D] float32
    chunk_logits: np.ndarray  # [n, K] float32
    frame_windows: np.ndarray  # [n, 2] int64: each chunk's [start, end) in video frames
    stride: int  # data.frame_stride: clip frames are this many video frames apart


@dataclass
class VideoResult:
    """A video classified (``error`` None) or one that could not be read (``error``: why, the rest empty)."""

    video: str | list[str]  # the file, or the camera views' files
    num_frames: int = 0
    fps: float = 0.0
    chunks: int = 0
    topk: list[dict] = field(default_factory=list)  # [{"label", "prob"}], most probable first
    decode_s: float = 0.0
    compute_s: float = 0.0  # the model's seconds, not waiting for the decoder
    label: str | None = None  # the manifest's label, if it has one
    scores: dict | None = None  # the timeline against the annotated segments (engine.metrics.segments)
    score_counts: dict | None = None  # what the video adds to the split's timeline scores (a resumed run re-adds it)
    chunk_results: list[dict] | None = None  # --timeline: each chunk's frames, seconds, label and probability
    segments: list[dict] | None = None  # --timeline: the runs of the per-frame labels
    frames: FrameTimeline | None = None  # --timeline: per frame, for the CSV and the picture
    features: ChunkFeatures | None = None  # --features
    error: str | None = None

    @property
    def correct(self) -> bool | None:
        """Is the top label the manifest's? None for a video without a label."""
        return None if self.label is None or not self.topk else self.topk[0]["label"] == self.label

    def to_json(self) -> dict:
        """The JSON line of --output: the fields that are set, in this order; never the arrays."""
        if self.error is not None:
            return {"video": self.video, "error": self.error}
        line = {
            "video": self.video,
            "num_frames": self.num_frames,
            "fps": self.fps,
            "chunks": self.chunks,
            "topk": self.topk,
            "decode_s": self.decode_s,
            "compute_s": self.compute_s,
        }
        if self.label is not None:
            line.update(label=self.label, correct=self.correct)
        optional = {
            "scores": self.scores,
            "score_counts": self.score_counts,
            "chunk_results": self.chunk_results,
            "segments": self.segments,
        }
        line.update({key: value for key, value in optional.items() if value is not None})
        return line
