"""Streaming inference: a long video's inference chunks decoded on a background thread, a few ahead of the
model, and classified chunk by chunk, so memory does not depend on the video's length. infer_chunked.py is its
command line.
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from config import DataConfig, TrainConfig
from core import memory_monitor
from datasets.chunk_stream import ChunkStream
from datasets.manifest import VideoRecord
from datasets.records import check_labels, segment_frames
from engine.chunking import clip_length, run_chunks, slice_time
from engine.timeline import merge_segments, timeline_agreement

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
    def of_config(cls, train_cfg: TrainConfig, topk: int = 3, timeline: bool = False,
                  decode_threads: int | None = None) -> InferenceSpec:
        """The inference chunks of a config (``train.chunk_infer_size``, ``chunk_overlap``, ``chunk_aggregation``,
        ``video_batch_size``): one representation, so what runs is what the config says."""
        return cls(train_cfg.chunk_infer_size, train_cfg.chunk_overlap, train_cfg.chunk_aggregation,
                   train_cfg.video_batch_size, topk, timeline, decode_threads)


@torch.inference_mode()
def classify_video(model, record: VideoRecord, data_cfg: DataConfig, spec: InferenceSpec, runtime, prepare,
                   class_names, keep_features: bool = False) -> dict:
    """One video's result: top-k labels, and with ``spec.timeline`` every chunk's and the merged segments.

    The chunks go through ``run_chunks``, the chunked forward of evaluation, as they are decoded: without a
    temporal head their logits are aggregated as they come; with one, only each chunk's features are kept (on the
    host, 4 bytes x D a chunk) and the head runs once at the end. ``keep_features``: the result also
    holds "features" (float32 [n, D], each chunk's backbone features after view fusion, on the host) and
    "chunk_logits" ([n, K]: the head's per-chunk outputs with a head), numpy arrays for ``engine.features``."""
    check_labels(record, class_names, unlabelled_ok=True)  # the checks and messages of train.py and eval.py
    stream = ChunkStream(record, data_cfg, spec)
    waited = 0.0  # seconds spent waiting for the decoder: not compute

    def groups():  # the decoded chunk groups, on the device: the frames run_chunks runs
        nonlocal waited
        decoded = iter(tqdm(stream, total=-(-len(stream.windows) // spec.batch), leave=False,
                            desc=os.path.basename(record.first_path), disable=not sys.stderr.isatty()))
        for count in itertools.count(1):
            tick = time.perf_counter()
            item = next(decoded, None)
            waited += time.perf_counter() - tick
            if item is None:
                return
            windows, tensors = item
            inputs = prepare(tensors)
            # a video shorter than the model's minimum clip: repeat its last frame (docs/long-videos.md)
            yield windows, slice_time(inputs, 0, clip_length(inputs), getattr(model, "min_frames", 1))
            if count % TRIM_EVERY == 0:  # freed chunk groups back to the system: RSS flat in video length
                memory_monitor.trim_freed_memory()

    try:
        if record.segments is not None:
            segment_frames(record, stream.num_frames, stream.fps, class_names)
        started = time.perf_counter()
        with runtime.autocast():
            out = run_chunks(model, groups(), stream.windows, spec.aggregation, stream.stride, keep_features,
                             features_on_host=True)
        compute_seconds = time.perf_counter() - started - waited
    finally:
        stream.close()
    chunk_logits = out.chunk_logits[:, 0]  # [n, K]: one video
    timeline = []
    for (s, e), p in zip(stream.windows, chunk_logits.softmax(dim=1)):
        start, end = s * stream.stride, min((e - 1) * stream.stride + 1, stream.num_frames)
        timeline.append({"start": start, "end": end, "start_sec": round(start / stream.fps, 3),
                         "end_sec": round(end / stream.fps, 3), "label": class_names[int(p.argmax())],
                         "prob": round(float(p.max()), 4)})
    probs = out.logits[0].float().softmax(dim=0)
    top = probs.topk(min(spec.topk, len(class_names)))
    result = {"video": record.first_path if len(record.views) == 1 else record.views,
              "num_frames": stream.num_frames, "fps": stream.fps, "chunks": len(timeline),
              "topk": [{"label": class_names[int(i)], "prob": round(float(v), 4)} for v, i in zip(top.values,
                                                                                              top.indices)],
              "decode_s": round(stream.decode_seconds, 3), "compute_s": round(compute_seconds, 3)}
    segments = merge_segments(timeline, stream.num_frames)
    if record.label is not None:
        result["label"] = record.label
        result["correct"] = result["topk"][0]["label"] == record.label
    if record.segments is not None:
        result["timeline_agreement"] = timeline_agreement(segments, record, stream.fps, stream.num_frames)
    if spec.timeline:
        result["timeline"] = timeline
        result["segments"] = segments
    if keep_features:
        result["features"], result["chunk_logits"] = out.features[0].numpy(), chunk_logits.numpy()
        result["frame_windows"] = [(row["start"], row["end"]) for row in timeline]
        result["stride"] = stream.stride
    return result
