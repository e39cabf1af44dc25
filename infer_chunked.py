"""Classify long videos window by window, streamed from the file: memory does not depend on video length.

    python infer_chunked.py --chunk 32 --overlap 8
    python infer_chunked.py --checkpoint best.pt --input video.mp4 --agg prob --timeline --output out.jsonl

Without --checkpoint, the best checkpoint of the most recent run under runs/ is used; without --input,
the test (else val) manifest of that checkpoint's config. Chunk and overlap count clip frames, that is
frames at the checkpoint's data.frame_stride. A background thread decodes the next inference chunks
while the model runs the current ones; frames shared by overlapping chunks are decoded once.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm import tqdm

import memory_estimate
import memory_monitor
from checkpoint import CheckpointError, load_trained_model
from chunked_forward import AGGREGATIONS, LogitAggregator, clip_length, inference_windows, slice_time
from cli import exit_on_usage_error
from config import ConfigError, apply_flags, load_config
from datasets.video_dataset import BAD_INPUT_ERRORS, check_labels, manifest_path, segment_frames
from datasets.clip_transform import ClipTransform, transform_keypoints
from datasets.keypoints import KeypointError, read_keypoints
from datasets.manifest import VIDEO_EXTENSIONS, VideoRecord, read_manifest
from datasets.transforms import InputPreparer
from datasets.video_reader import open_reader, probe, several_streams_note
from runtime import resolve_device, setup_logging, setup_runtime

log = logging.getLogger("longvideo")  # set up by main(): importing this module configures nothing


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="checkpoint (default: best.pt of the experiment of --config, else the "
                                             "most recent best.pt in --runs)")
    parser.add_argument("--config", help="a training preset: its experiment's latest run gives the checkpoint")
    parser.add_argument("--runs", default="runs", help="where to look for the most recent run")
    parser.add_argument("--input", help="a video file, a directory of videos, or a manifest (.jsonl/.csv)")
    parser.add_argument("--chunk", type=int, help="clip frames per inference chunk; -1 = whole video (default: the "
                                                   "checkpoint config's train.chunk_infer_size)")
    parser.add_argument("--overlap", type=int, help="clip frames shared by consecutive chunks (default: "
                                                    "train.chunk_overlap)")
    parser.add_argument("--agg", choices=AGGREGATIONS, help="how chunk logits are aggregated (default: "
                                                            "train.chunk_aggregation)")
    parser.add_argument("--batch", metavar="N|auto",
                        help="inference chunks per forward call (default: train.video_batch_size); auto = the most "
                             "whose estimated device memory fits --memory-budget-gb (memory_estimate.py)")
    parser.add_argument("--memory-budget-gb", type=float,
                        help="the memory --batch auto fits (default: the checkpoint's trainer.memory_budget_gb)")
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    parser.add_argument("--precision", help="32, 16, bf16 or amp (default: the checkpoint's)")
    parser.add_argument("--topk", type=int, default=3, help="labels reported per video")
    parser.add_argument("--output", help="write one JSON line per video to this file")
    parser.add_argument("--timeline", action="store_true", help="include every chunk's result and merged segments")
    parser.add_argument("--decode-threads", type=int, default=0,
                        help="FFmpeg decoder threads (0 = OpenCV's choice, all cores)")
    parser.add_argument("--max-videos", type=int, help="stop after this many videos")
    args = parser.parse_args(argv)
    if args.batch not in (None, "auto"):
        try:
            args.batch = int(args.batch)
        except ValueError:
            raise ConfigError(f"--batch {args.batch}: expected a number of chunks, or auto")
    if args.topk < 1:
        raise ConfigError(f"--topk {args.topk}: must be >= 1")
    return args


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


def inference_spec(args, cfg: dict, runtime, class_count: int, state: dict) -> InferenceSpec:
    """The flags over the checkpoint config's defaults, validated by config.py (its messages name the flag)."""
    train = apply_flags(cfg, {"train.chunk_infer_size": ("--chunk", args.chunk),
                              "train.chunk_overlap": ("--overlap", args.overlap),
                              "train.chunk_aggregation": ("--agg", args.agg),
                              "train.video_batch_size": ("--batch", None if args.batch == "auto" else args.batch)}
                        )["train"]
    spec = InferenceSpec(train["chunk_infer_size"], train["chunk_overlap"], train["chunk_aggregation"],
                         train["video_batch_size"], args.topk, args.timeline, args.decode_threads or None)
    if args.batch == "auto":
        spec = replace(spec, batch=fit_inference_batch(args, cfg, runtime, class_count, state, spec.chunk))
    return spec


def fit_inference_batch(args, cfg: dict, runtime, num_classes: int, state: dict, chunk: int) -> int:
    """--batch auto: the most chunks per forward whose estimated peak fits the budget."""
    budget = args.memory_budget_gb or cfg["trainer"]["memory_budget_gb"]
    if not budget:
        raise ConfigError("--batch auto needs a memory budget: --memory-budget-gb N (the checkpoint's config has no "
                          "trainer.memory_budget_gb)")
    cuda = runtime.device.type == "cuda"
    usable = memory_estimate.usable_bytes(budget, cuda)
    frames = chunk if chunk != -1 else memory_estimate.clip_frames(cfg)
    shape = {"num_classes": num_classes, "num_views": state.get("num_views", 1),
             "kpt_shape": tuple(state["kpt_shape"]) if state.get("kpt_shape") else None}
    batch = memory_estimate.largest_inference_batch(cfg, frames, usable, precision=runtime.precision, **shape)
    if not batch:
        raise ConfigError(f"--batch auto: even 1 chunk of {frames} frames does not fit the "
                          f"{memory_estimate.margin_text(budget, cuda)}; use a shorter --chunk")
    print(f"--batch auto: {batch} chunks of {frames} frames per forward ({memory_estimate.margin_text(budget, cuda)})")
    return batch


def find_checkpoint(args) -> tuple[str, str]:
    """(checkpoint, why it was chosen): --checkpoint; the latest run of --config's experiment; or the most recently
    written best.pt of any experiment under --runs (the last one trained)."""
    if args.checkpoint:
        return args.checkpoint, "--checkpoint"
    if args.config:
        cfg = load_config(args.config)
        path = os.path.join(cfg["trainer"]["output_dir"], cfg["experiment"], "latest", "checkpoints", "best.pt")
        if not os.path.exists(path):
            raise ConfigError(f"--config {args.config}: no {path} (experiment '{cfg['experiment']}' has no trained "
                              f"run here); train it first or pass --checkpoint PATH")
        return path, f"the latest run of experiment '{cfg['experiment']}' ({args.config})"
    candidates = glob.glob(os.path.join(args.runs, "*", "*", "checkpoints", "best.pt"))
    if not candidates:
        raise ConfigError(f"no --checkpoint given and no {args.runs}/<experiment>/<run>/checkpoints/best.pt found; "
                          f"train first or pass --checkpoint PATH")
    return max(candidates, key=os.path.getmtime), (f"the most recently written best.pt under {args.runs}/ (--config "
                                                  f"or --checkpoint to choose another)")


def resolve_inputs(input_arg: str | None, cfg: dict) -> tuple[str, list[VideoRecord]]:
    if input_arg is None:
        for split in ("test", "val"):
            path = manifest_path(cfg["data"], split)
            if path and os.path.exists(path):
                return path, read_manifest(path)
        raise ConfigError("no --input given and the checkpoint's config has no test or val manifest on this machine")
    if os.path.isdir(input_arg):
        files = sorted(f for f in os.listdir(input_arg) if f.lower().endswith(VIDEO_EXTENSIONS))
        if files:
            return input_arg, [VideoRecord({"video": os.path.join(input_arg, f)}, where=input_arg) for f in files]
        if any(os.path.isdir(os.path.join(input_arg, d)) for d in os.listdir(input_arg)):
            return input_arg, read_manifest(input_arg)  # root/<class>/<video>, as training reads it: labelled
        raise ConfigError(f"--input {input_arg}: no videos in this directory nor in class folders under it "
                          f"({', '.join(VIDEO_EXTENSIONS)})")
    if input_arg.endswith((".jsonl", ".json", ".csv")):
        return input_arg, read_manifest(input_arg)
    if not os.path.exists(input_arg):
        raise ConfigError(f"--input {input_arg}: file not found")
    return input_arg, [VideoRecord({"video": input_arg}, where=input_arg)]


class ChunkStream:
    """Decodes a video's inference chunks on a background thread, a few chunks ahead of the model.

    Yields (windows, {"video": uint8 [n, (V,) C, L, H, W], "kpt": [n, L, J, C]}) for groups of ``batch``
    chunks. Window bounds are in clip frames; clip frame i is video frame i * stride.
    """

    def __init__(self, record: VideoRecord, data_cfg: dict, spec: InferenceSpec, prefetch: int = 2):
        """data_cfg: the frame size, stride, decoder and what to load (RGB, keypoints) of the config."""
        self.record, self.stride = record, data_cfg["frame_stride"]
        # evaluation's geometry: aspect-true decode size and the centre crop (data.test_crops is eval.py's)
        transform = ClipTransform({**data_cfg, "test_crops": 1}, training=False)
        infos = {name: probe(path, data_cfg["decoder"]) for name, path in record.views.items()}
        self.geometry = dict(zip(infos, transform.plan([(info.height, info.width) for info in infos.values()], None)))
        self.readers = {name: open_reader(path, self.geometry[name].decoded, threads=spec.decode_threads,
                                          info=infos[name], decoder=data_cfg["decoder"], access="sequential")
                        for name, path in record.views.items()}
        self.kpt_coords = data_cfg["kpt_coords"]
        first = next(iter(self.readers.values()))
        for reader in self.readers.values():
            note = several_streams_note(reader.info)
            if note:
                log.warning("%s", note)
            # a container can over-state its length (a cut file keeps its header): reading the last frame it
            # claims finds the real end, so no chunk is made of the last frame repeated
            reader.read([reader.num_frames - 1])
        self.num_frames = min(r.num_frames for r in self.readers.values())
        self.fps = first.info.fps
        clip_length = len(range(0, self.num_frames, self.stride))
        self.windows = inference_windows(clip_length, spec.chunk, spec.overlap, spec.aggregation)
        self.batch, self.load_rgb, self.load_kpt = spec.batch, data_cfg["load_rgb"], data_cfg["load_kpt"]
        if self.load_kpt and record.keypoints is None:
            raise KeypointError(f"{record.where}: the model needs keypoints but the input has none "
                                f"(give a manifest line with 'keypoints')")
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.decode_seconds = 0.0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._produce, daemon=True)
        self.thread.start()

    def _produce(self) -> None:
        try:
            cache: dict[int, dict[str, np.ndarray]] = {}  # clip frame -> view -> frame: the overlap, decoded once
            for first in range(0, len(self.windows), self.batch):
                if self.stopping.is_set():
                    return
                group = self.windows[first:first + self.batch]
                tick = time.perf_counter()
                new = sorted({i for s, e in group for i in range(s, e)} - cache.keys())
                if self.load_rgb and new:
                    for name, reader in self.readers.items():
                        box = self.geometry[name].box
                        for i, frame in zip(new, reader.read([i * self.stride for i in new])):
                            cache.setdefault(i, {})[name] = frame[box.top:box.top + box.height,
                                                                  box.left:box.left + box.width]
                tensors = {}
                if self.load_rgb:
                    first_frame = cache[group[0][0]][next(iter(self.readers))]
                    length = group[0][1] - group[0][0]
                    video = np.empty((len(group), len(self.readers), length, *first_frame.shape), np.uint8)
                    for k, (s, e) in enumerate(group):  # one copy from the cache into the batch
                        for v, name in enumerate(self.readers):
                            for t, i in enumerate(range(s, e)):
                                video[k, v, t] = cache[i][name]
                    video = torch.from_numpy(video).permute(0, 1, 5, 2, 3, 4)  # [n, V, C, L, H, W], no copy
                    tensors["video"] = video[:, 0] if len(self.readers) == 1 else video
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
        kpt = read_keypoints(self.record.keypoints, [i * self.stride for i in range(start, end)])
        if not self.load_rgb:  # no frames, no geometry to follow (the dataset does the same)
            return kpt
        return transform_keypoints(kpt, next(iter(self.geometry.values())), self.kpt_coords)

    def _put(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        while True:
            item = self.queue.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop the decoding thread (also when the consumer failed half-way), then release the files."""
        self.stopping.set()
        self.thread.join()
        for reader in self.readers.values():
            reader.close()


@torch.inference_mode()
def classify_video(model, record: VideoRecord, cfg: dict, spec: InferenceSpec, runtime, prepare,
                   class_names) -> dict:
    check_labels(record, class_names, unlabelled_ok=True)  # the checks and messages of train.py and eval.py
    stream = ChunkStream(record, cfg["data"], spec)
    aggregator, timeline = LogitAggregator(spec.aggregation), []
    compute_seconds = 0.0
    try:
        if record.segments is not None:
            segment_frames(record, stream.num_frames, stream.fps, class_names)
        for windows, tensors in tqdm(stream, total=-(-len(stream.windows) // spec.batch), leave=False,
                                     desc=os.path.basename(record.first_path), disable=not sys.stderr.isatty()):
            tick = time.perf_counter()
            inputs = prepare(tensors)
            # a video shorter than the model's minimum clip: repeat its last frame (documented in the README)
            inputs = slice_time(inputs, 0, clip_length(inputs), getattr(model, "min_frames", 1))
            with runtime.autocast():
                logits = model(inputs).float()
            aggregator.update(logits.unsqueeze(1))  # [n, 1, K]
            probs = logits.softmax(dim=1).cpu()
            compute_seconds += time.perf_counter() - tick
            for (s, e), p in zip(windows, probs):
                start, end = s * stream.stride, min((e - 1) * stream.stride + 1, stream.num_frames)
                timeline.append({"start": start, "end": end, "start_sec": round(start / stream.fps, 3),
                                 "end_sec": round(end / stream.fps, 3), "label": class_names[int(p.argmax())],
                                 "prob": round(float(p.max()), 4)})
    finally:
        stream.close()
    probs = aggregator.result()[0].softmax(dim=0)
    top = probs.topk(min(spec.topk, len(class_names)))
    result = {"video": record.first_path if len(record.views) == 1 else record.views,
              "num_frames": stream.num_frames, "fps": stream.fps, "windows": len(timeline),
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
    return result


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


def print_result(result: dict, show_timeline: bool) -> None:
    top = ", ".join(f"{t['label']} {t['prob']:.2f}" for t in result["topk"])
    truth = f"  (true: {result['label']})" if "label" in result else ""
    print(f"{result['video']}: {result['num_frames']} frames @ {result['fps']:.1f} fps, {result['windows']} chunks "
          f"-> {top}{truth}")
    if "timeline_agreement" in result:
        print(f"  timeline agreement with the annotated segments: {100 * result['timeline_agreement']:.1f}% of frames")
    if show_timeline:
        print(f"  {'start':>8s} {'end':>8s} {'start s':>8s} {'end s':>8s}  label")
        for seg in result["segments"]:
            print(f"  {seg['start']:8d} {seg['end']:8d} {seg['start'] / result['fps']:8.2f} "
                  f"{seg['end'] / result['fps']:8.2f}  {seg['label']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    checkpoint_path, why = find_checkpoint(args)
    device = resolve_device(args.device or "auto")
    model, cfg, class_names, state = load_trained_model(checkpoint_path, device)
    runtime = setup_runtime(cfg["trainer"], device=str(device), precision=args.precision)
    spec = inference_spec(args, cfg, runtime, len(class_names), state)
    source, records = resolve_inputs(args.input, cfg)
    if args.max_videos:
        records = records[:args.max_videos]
    print(f"checkpoint: {checkpoint_path} ({why})\ninput: {source} ({len(records)} videos)\n"
          f"chunk {spec.chunk} overlap {spec.overlap} agg {spec.aggregation} batch {spec.batch} on {runtime.device}")
    prepare = InputPreparer(runtime.device, cfg["data"]["mean"], cfg["data"]["std"])
    if runtime.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(runtime.device)
    failures, correct, labelled = 0, 0, 0
    out = open(args.output, "w") if args.output else None
    try:
        for record in tqdm(records, desc="videos", disable=not sys.stderr.isatty() or len(records) == 1):
            try:
                result = classify_video(model, record, cfg, spec, runtime, prepare, class_names)
            except BAD_INPUT_ERRORS as e:
                if len(records) == 1:
                    raise
                failures += 1
                result = {"video": record.first_path, "error": str(e)}
                print(f"error: {e}", file=sys.stderr)
            if "correct" in result:
                labelled += 1
                correct += int(result["correct"])
            if out is not None:
                out.write(json.dumps(result) + "\n")
                out.flush()
            if "error" not in result:  # the console shows the summary with --output too
                print_result(result, spec.timeline)
    finally:
        if out is not None:
            out.close()
    if labelled:
        print(f"accuracy: {correct}/{labelled} = {correct / labelled:.4f}")
    snap = memory_monitor.snapshot(runtime.device)
    peak = f", device peak {snap['device_peak_mb']:.0f} MB" if "device_peak_mb" in snap else ""
    print(f"peak memory: host RSS {memory_monitor.host_peak_rss_mb():.0f} MB{peak}")
    return 1 if failures else 0


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS + (CheckpointError,))
