"""Streaming inference: a long video's inference chunks decoded on a background thread, a few ahead of the
model, and classified chunk by chunk, so memory does not depend on the video's length. infer_chunked.py is its
command line.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from config import DataConfig, TrainConfig
from core import memory_monitor
from core.errors import UsageError
from datasets.clip_transform import ClipTransform
from datasets.decode import read_clip, read_clip_keypoints
from datasets.keypoints import KeypointError
from datasets.manifest import VIDEO_EXTENSIONS, VideoRecord, read_manifest
from datasets.records import check_labels, manifest_path, segment_frames
from datasets.video.choice import open_reader
from datasets.video.info import StalledFile, several_streams_note
from datasets.video.probe import probe
from engine.chunking import clip_length, inference_windows, run_chunks, slice_time
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


def resolve_inputs(input_arg: str | None, data_cfg: DataConfig) -> tuple[str, list[VideoRecord]]:
    if input_arg is None:
        for split in ("test", "val"):
            path = manifest_path(data_cfg, split)
            if path and os.path.exists(path):
                return path, read_manifest(path)
        raise UsageError("no --input given and the checkpoint's config has no test or val manifest on this machine")
    if os.path.isdir(input_arg):
        files = sorted(f for f in os.listdir(input_arg) if f.lower().endswith(VIDEO_EXTENSIONS))
        if files:
            return input_arg, [VideoRecord({"video": os.path.join(input_arg, f)}, where=input_arg) for f in files]
        if any(os.path.isdir(os.path.join(input_arg, d)) for d in os.listdir(input_arg)):
            return input_arg, read_manifest(input_arg)  # root/<class>/<video>, as training reads it: labelled
        raise UsageError(f"--input {input_arg}: no videos in this directory nor in class folders under it "
                          f"({', '.join(VIDEO_EXTENSIONS)})")
    if input_arg.endswith((".jsonl", ".json", ".csv")):
        return input_arg, read_manifest(input_arg)
    if not os.path.exists(input_arg):
        raise UsageError(f"--input {input_arg}: file not found")
    return input_arg, [VideoRecord({"video": input_arg}, where=input_arg)]


class ChunkStream:
    """Decodes a video's inference chunks on a background thread, a few chunks ahead of the model.

    Yields (windows, {"video": uint8 [n, (V,) C, L, H, W], "kpt": [n, L, J, C]}) for groups of ``batch``
    chunks. Window bounds are in clip frames; clip frame i is video frame i * stride.

    Every file access (the probe, the open, each group's decoding) happens on the thread, and the consumer waits
    for each at most data.sample_timeout_s: a file on a stalled mount is a StalledFile naming the file and the
    chunks, not a hang; the blocked thread is left behind (a daemon: it cannot be interrupted inside FFmpeg).
    """

    def __init__(self, record: VideoRecord, data_cfg: DataConfig, spec: InferenceSpec, prefetch: int = 2):
        """data_cfg: the frame size, stride, decoder and what to load (RGB, keypoints) of the config."""
        self.record, self.stride, self.timeout = record, data_cfg.frame_stride, data_cfg.sample_timeout_s
        self.readers: dict = {}
        self.waiting_for = "its header"  # what the thread is reading, for the stall's message
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.decode_seconds = 0.0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(data_cfg, spec), daemon=True)
        self.thread.start()
        ready = self._get()
        if isinstance(ready, BaseException):
            self.close()
            raise ready

    def _run(self, data_cfg: DataConfig, spec: InferenceSpec) -> None:
        try:
            self._open(data_cfg, spec)
        except BaseException as e:  # hand the error to the consumer
            self._put(e)
            return
        self._put("ready")
        self._produce()

    def _open(self, data_cfg: DataConfig, spec: InferenceSpec) -> None:
        record = self.record
        # evaluation's geometry: aspect-true decode size and the centre crop (data.test_crops is eval.py's)
        self.transform = ClipTransform(dataclasses.replace(data_cfg, test_crops=1), training=False)
        infos = {name: probe(path, data_cfg.decoder) for name, path in record.views.items()}
        self.plans = self.transform.plan([info.frame_size(data_cfg.autorotate) for info in infos.values()], None)
        self.readers = {name: open_reader(path, plan.decoded, threads=spec.decode_threads, info=infos[name],
                                          decoder=data_cfg.decoder, access="sequential",
                                          autorotate=data_cfg.autorotate)
                        for plan, (name, path) in zip(self.plans, record.views.items())}
        first = next(iter(self.readers.values()))
        for reader in self.readers.values():
            for note in filter(None, (several_streams_note(reader.info), reader.info.header_note())):
                log.warning("%s", note)
            # a container can over-state its length (a cut file keeps its header): reading the last frame it
            # claims finds the real end, so no chunk is made of the last frame repeated
            self.waiting_for = f"its last frame ({reader.num_frames - 1})"
            reader.read([reader.num_frames - 1])
        self.num_frames = min(r.num_frames for r in self.readers.values())
        self.fps = first.info.fps
        clip_length = len(range(0, self.num_frames, self.stride))
        self.windows = inference_windows(clip_length, spec.chunk, spec.overlap, spec.aggregation)
        self.batch, self.load_rgb, self.load_kpt = spec.batch, data_cfg.load_rgb, data_cfg.load_kpt
        if self.load_kpt and record.keypoints is None:
            raise KeypointError(f"{record.where}: the model needs keypoints but the input has none "
                                f"(give a manifest line with 'keypoints')")

    def _produce(self) -> None:
        try:
            cache: dict[int, list] = {}  # clip frame -> each view's frame: the overlap, decoded once
            for first in range(0, len(self.windows), self.batch):
                if self.stopping.is_set():
                    return
                group = self.windows[first:first + self.batch]
                self.waiting_for = (f"inference chunks {group[0][0]}..{group[-1][1]} (clip frames; video frames "
                                    f"{group[0][0] * self.stride}..{(group[-1][1] - 1) * self.stride + 1})")
                tick = time.perf_counter()
                new = sorted({i for s, e in group for i in range(s, e)} - cache.keys())
                if self.load_rgb and new:  # datasets.decode.read_clip: the dataset's path from file to frames
                    views = read_clip(list(self.readers.values()), [i * self.stride for i in new], self.plans,
                                      self.transform)
                    for t, i in enumerate(new):
                        cache[i] = [view[:, t] for view in views]  # each [C, H, W]
                tensors = {}
                if self.load_rgb:
                    channels, height, width = cache[group[0][0]][0].shape
                    length = group[0][1] - group[0][0]
                    video = torch.empty((len(group), len(self.readers), channels, length, height, width),
                                        dtype=torch.uint8)
                    for k, (s, e) in enumerate(group):  # one copy from the cache into the batch
                        for t, i in enumerate(range(s, e)):
                            for v, frame in enumerate(cache[i]):
                                video[k, v, :, t] = frame
                    tensors["video"] = video[:, 0] if len(self.readers) == 1 else video  # [n, (V,) C, L, H, W]
                if self.load_kpt:
                    tensors["kpt"] = torch.stack([torch.from_numpy(self._keypoints(s, e)) for s, e in group])
                following = first + self.batch
                keep_from = self.windows[following][0] if following < len(self.windows) else float("inf")
                for i in [i for i in cache if i < keep_from]:
                    del cache[i]
                self.decode_seconds += time.perf_counter() - tick
                self._put((group, tensors))
            self._put(None)
        except BaseException as e:  # hand the error to the consumer
            self._put(e)

    def _keypoints(self, start: int, end: int) -> np.ndarray:
        """The keypoints of clip frames [start, end), following the first view's crop (as in training)."""
        indices = [i * self.stride for i in range(start, end)]
        return read_clip_keypoints(self.record, indices, self.plans if self.load_rgb else [], self.transform)

    def _put(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _get(self):
        """The thread's next item, waiting at most data.sample_timeout_s for it."""
        try:
            return self.queue.get(timeout=self.timeout)
        except queue.Empty:
            return StalledFile(f"{self.record.first_path}: no answer within {self.timeout:g} s while reading "
                               f"{self.waiting_for} (data.sample_timeout_s): a stalled mount or a decoder that "
                               f"does not return")

    def __iter__(self):
        while True:
            item = self._get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop the decoding thread (also when the consumer failed half-way), then release the files. A thread
        blocked in the decoder past the deadline is left behind with its files."""
        self.stopping.set()
        self.thread.join(timeout=self.timeout)
        if not self.thread.is_alive():
            for reader in self.readers.values():
                reader.close()


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
