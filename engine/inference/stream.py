"""Streaming inference's machinery: a video's decoded chunk groups on the device (``StreamedGroups``), the chunked
forward over them for evaluation's whole sample windows (``run_stream``), and a streamed video's result
(``video_result``). infer_chunked.py holds the loop over a video's chunks itself.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from config import Config, InferConfig
from core import memory_monitor, watchdog
from datasets.chunk_stream import ChunkStream
from datasets.manifest import VideoRecord
from datasets.records import frame_labels, segment_frames
from engine.inference.chunks import ChunkedOutput, ChunkOutputs, clip_length, slice_time
from engine.inference.timeline import annotated, frame_probabilities, segments_of_frames
from engine.inference.video_result import ChunkFeatures, FrameTimeline, VideoResult
from engine.metrics.segments import SegmentationScores

log = logging.getLogger("longvideo")
TRIM_EVERY = 32  # chunk groups between two malloc_trim calls (core.memory_monitor.trim_freed_memory)


@dataclass(frozen=True)
class InferenceSpec:
    """How a video goes through the model: its inference chunks, their aggregation, chunks per forward call,
    and what is reported."""

    chunk: int = 32  # clip frames per chunk; -1 = the whole video
    overlap: int = 8
    aggregation: str = "mean"
    batch: int = 1  # chunks per forward call
    topk: int = 3
    timeline: bool = False
    decode_threads: int | None = None  # None: FFmpeg's choice

    @classmethod
    def of_config(
        cls, infer_cfg: InferConfig, topk: int = 3, timeline: bool = False, decode_threads: int | None = None
    ) -> InferenceSpec:
        """The inference chunks of a config's infer section: one representation, so what runs is what the config
        says."""
        return cls(
            infer_cfg.chunk_size,
            infer_cfg.chunk_overlap,
            infer_cfg.chunk_aggregation,
            infer_cfg.chunks_per_forward,
            topk,
            timeline,
            decode_threads,
        )


def how_it_runs(cfg: Config, head_reach: str) -> str:
    """The line eval.py and infer_chunked.py print of how the model runs over a video: its inference chunks and
    their aggregation, or the temporal head and how many chunks it sees at once (``head_reach``)."""
    infer, head = cfg.infer, cfg.model.temporal_head
    aggregation = f"temporal head {head}, {head_reach}" if head != "none" else f"agg {infer.chunk_aggregation}"
    return f"chunk {infer.chunk_size} overlap {infer.chunk_overlap} {aggregation}"


class StreamedGroups:
    """A stream's decoded chunk groups as model inputs on the device, in order: (the group's windows, its inputs
    with the chunks stacked on the batch axis), each chunk padded to the model's ``min_frames`` by repeating its
    last frame (a video shorter than the model's minimum clip). ``waited``: the seconds spent waiting for the
    decoder. Under torchrun each group is progress for the watchdog; freed groups go back to the system now and then,
    so resident memory stays flat in the video's length."""

    def __init__(self, stream: ChunkStream, device_inputs, min_frames: int = 1):
        self.stream, self.device_inputs, self.min_frames = stream, device_inputs, min_frames
        self.waited = 0.0

    def __iter__(self):
        stream = self.stream
        decoded = iter(
            tqdm(
                stream,
                total=-(-len(stream.windows) // stream.batch),
                leave=False,
                desc=os.path.basename(stream.record.first_path),
                disable=not sys.stderr.isatty(),
            )
        )
        for count in itertools.count(1):
            tick = time.perf_counter()
            item = next(decoded, None)
            self.waited += time.perf_counter() - tick
            if item is None:
                return
            windows, tensors = item
            inputs = self.device_inputs(tensors)
            yield windows, slice_time(inputs, 0, clip_length(inputs), self.min_frames)
            watchdog.beat()  # under torchrun, a whole window streamed in validation is progress chunk by chunk
            if count % TRIM_EVERY == 0:
                memory_monitor.trim_freed_memory()


def run_stream(
    model, stream: ChunkStream, device_inputs, runtime, aggregation: str, keep_features: bool = False
) -> tuple[ChunkedOutput, float]:
    """(The chunked forward over a stream's chunks as they are decoded, the seconds of compute: not waiting for the
    decoder): evaluation's streaming of whole sample windows, the loop of infer_chunked.py's ``classify_video``.
    Chunk features or logits go to the host, and a temporal head runs once at the end, so memory is flat in the
    video's length."""
    outputs = ChunkOutputs(model, aggregation, stream.stride, keep_features, features_on_host=True)
    groups = StreamedGroups(stream, device_inputs, getattr(model, "min_frames", 1))
    started = time.perf_counter()
    with runtime.autocast():
        for windows, inputs in groups:
            outputs.add(windows, inputs)
        out = outputs.result(stream.windows)
    return out, time.perf_counter() - started - groups.waited


def annotated_frames(record: VideoRecord, stream: ChunkStream, class_names) -> np.ndarray | None:
    """Each streamed frame's annotated class index (-1 where no segment is), or None for a video without
    segments."""
    if record.segments is None:
        return None
    return frame_labels(
        segment_frames(record, stream.num_frames, stream.fps, class_names), np.arange(stream.num_frames)
    )


def video_result(
    record: VideoRecord,
    stream: ChunkStream,
    out: ChunkedOutput,
    compute_seconds: float,
    spec: InferenceSpec,
    class_names,
    scores: SegmentationScores | None = None,
    keep_features: bool = False,
) -> VideoResult:
    """A streamed video's result: top-k labels; with ``spec.timeline`` every chunk's result, the per-frame timeline
    and its segments (timeline.py: the chunks' probabilities blended per frame). A video with annotated segments is
    scored as a timeline (its ``scores``, added to ``scores``: the split's). ``keep_features``: the result also holds
    its ``ChunkFeatures``, for ``engine.inference.features``."""
    truth = annotated_frames(record, stream, class_names)
    chunk_logits = out.chunk_logits[:, 0]  # [n, K]: one video
    chunk_probs = chunk_logits.softmax(dim=1)
    frame_windows = np.array(
        [[s * stream.stride, min((e - 1) * stream.stride + 1, stream.num_frames)] for s, e in stream.windows],
        dtype=np.int64,
    ).reshape(-1, 2)
    probs = out.logits[0].float().softmax(dim=0)
    top = probs.topk(min(spec.topk, len(class_names)))
    result = VideoResult(
        record.video,
        stream.num_frames,
        stream.fps,
        len(frame_windows),
        [{"label": class_names[int(i)], "prob": round(float(v), 4)} for v, i in zip(top.values, top.indices)],
        round(stream.decode_seconds, 3),
        round(compute_seconds, 3),
        record.label,
    )
    if spec.timeline or truth is not None:
        add_timeline(result, chunk_probs.numpy(), frame_windows, class_names, truth, scores, spec.timeline)
    if keep_features:
        result.features = ChunkFeatures(out.features[0].numpy(), chunk_logits.numpy(), frame_windows, stream.stride)
    return result


def add_timeline(
    result: VideoResult,
    chunk_probs: np.ndarray,
    frame_windows: np.ndarray,
    class_names: list[str],
    truth: np.ndarray | None,
    scores: SegmentationScores | None,
    full: bool,
) -> None:
    """A video's per-frame timeline (its chunks' probabilities blended, engine.inference.timeline) into ``result``: its
    scores against the annotated ``truth`` (added to the split's ``scores``); with ``full``, every chunk's result,
    the segments, and the per-frame labels (for --output's CSV and --plot)."""
    fps = result.fps
    per_frame = frame_probabilities(chunk_probs, frame_windows, result.num_frames)
    labels = per_frame.argmax(axis=1)
    if truth is not None and scores is not None:
        result.score_counts = scores.counts_of(*annotated(labels, truth))
        result.scores = scores.add_counts(result.score_counts)
    if full:
        result.chunk_results = [
            {
                "start": int(start),
                "end": int(end),
                "start_sec": round(start / fps, 3),
                "end_sec": round(end / fps, 3),
                "label": class_names[int(p.argmax())],
                "prob": round(float(p.max()), 4),
            }
            for (start, end), p in zip(frame_windows, chunk_probs)
        ]
        result.segments = segments_of_frames(labels, fps, class_names)
        result.frames = FrameTimeline(labels, per_frame[np.arange(len(labels)), labels], truth)
