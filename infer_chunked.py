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
import csv
import io
import json
import os
import sys
import time
from collections import Counter

import torch
from tqdm import tqdm

from artifacts.checkpoint import CheckpointError
from artifacts.run_dir import ExperimentDirectory, most_recent_best
from artifacts.timeline_plot import ROW_MINUTES, timeline_plot
from artifacts.trained_model import load_trained_model
from config import Config, add_head_window_flag, apply_inference_flags, load_config
from core import memory_monitor
from core.cli import exit_on_usage_error
from core.errors import UsageError
from core.files import append_whole, atomic_write_bytes, file_sha256
from core.logs import setup_logging
from core.runtime import resolve_device, setup_runtime
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.device_input import InputPreparer
from datasets.records import resolve_inputs
from datasets.shape import DataShape
from datasets.video.capture import quiet_decoder_logs
from datasets.video.info import StalledFile
from engine.chunking import AGGREGATIONS
from engine.features import (
    FEATURE_DTYPES,
    FeatureSpec,
    done_before,
    feature_names,
    parse_shard,
    prepare_directory,
    settings_of,
    shard,
    write_features,
)
from engine.inference import InferenceSpec, classify_video
from engine.segment_metrics import SegmentationScores, background_indices, format_scores
from models import set_temporal_window
from planner.batch_size import inference_batch_for_budget


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="checkpoint (default: best.pt of the experiment of --config, else the "
                                             "most recent best.pt in --runs)")
    parser.add_argument("--backbone", metavar="PATH",
                        help="a temporal head trained on features (data.features_dir) runs with the backbone "
                             "checkpoint that wrote them, found where it was; give it here if it moved (its sha256 "
                             "is checked)")
    parser.add_argument("--config", help="a training preset: its experiment's latest run gives the checkpoint")
    parser.add_argument("--runs", default="runs", help="where to look for the most recent run")
    parser.add_argument("--input", help="a video file, a directory of videos, or a manifest (.jsonl/.csv)")
    parser.add_argument("--chunk", type=int, help="clip frames per inference chunk; -1 = whole video (default: the "
                                                   "checkpoint config's train.chunk_infer_size)")
    parser.add_argument("--overlap", type=int, help="clip frames shared by consecutive chunks (default: "
                                                    "train.chunk_overlap)")
    parser.add_argument("--agg", choices=AGGREGATIONS, help="how chunk logits are aggregated (default: "
                                                            "train.chunk_aggregation)")
    add_head_window_flag(parser)
    parser.add_argument("--batch", metavar="N|auto",
                        help="inference chunks per forward call (default: train.video_batch_size); auto = the most "
                             "whose estimated device memory fits --memory-budget-gb (the memory planner)")
    parser.add_argument("--memory-budget-gb", type=float,
                        help="the memory --batch auto fits (default: the checkpoint's trainer.memory_budget_gb)")
    parser.add_argument("--sample-timeout", type=float, metavar="SECONDS",
                        help="seconds a video's header or one group of chunks may take to decode before the video "
                             "counts as unreadable (default: the checkpoint's data.sample_timeout_s)")
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    parser.add_argument("--precision", help="32, 16, bf16 or amp (default: the checkpoint's)")
    parser.add_argument("--topk", type=int, default=3, help="labels reported per video")
    parser.add_argument("--output", help="write one JSON line per video to this file (with --timeline: its segments; "
                                         "and OUTPUT_frames.csv: every frame's label); with annotated segments, "
                                         "OUTPUT_scores.json: the timeline scores over all videos")
    parser.add_argument("--timeline", action="store_true",
                        help="per-frame timelines: every chunk's result, and the segments of the frames' labels (each "
                             "frame's probabilities blended from the chunks that cover it)")
    parser.add_argument("--plot", metavar="DIR", help="with --timeline: DIR/<video stem>.png per video, ground truth "
                                                      "(where annotated) above the prediction and the frames where "
                                                      "they disagree, in rows of --plot-row-minutes")
    parser.add_argument("--plot-row-minutes", type=float, default=ROW_MINUTES, metavar="M",
                        help=f"--plot: minutes of video a row (default {ROW_MINUTES:g}; at most 24 rows: a longer "
                             f"video gets longer rows)")
    parser.add_argument("--decode-threads", type=int, default=0,
                        help="FFmpeg decoder threads (0 = OpenCV's choice, all cores)")
    parser.add_argument("--max-videos", type=int, help="stop after this many videos")
    parser.add_argument("--features", metavar="DIR",
                        help="also write each video's per-chunk features to DIR/<stem>.npz (docs/inference.md); a "
                             "video whose file is there with the same settings is skipped")
    parser.add_argument("--features-dtype", choices=FEATURE_DTYPES, default="float16",
                        help="dtype of the stored features (the logits are always float32)")
    parser.add_argument("--shard", metavar="i/N",
                        help="take every N-th video from the i-th (0-based): N processes or machines split the input")
    args = parser.parse_args(argv)
    if args.batch not in (None, "auto"):
        try:
            args.batch = int(args.batch)
        except ValueError:
            raise UsageError(f"--batch {args.batch}: expected a number of chunks, or auto")
    if args.topk < 1:
        raise UsageError(f"--topk {args.topk}: must be >= 1")
    if args.plot and not args.timeline:
        raise UsageError(f"--plot {args.plot}: plots a timeline; add --timeline")
    if not args.plot_row_minutes > 0:
        raise UsageError(f"--plot-row-minutes {args.plot_row_minutes:g}: give the minutes of video a row shows, "
                         f"more than 0 (default {ROW_MINUTES:g})")
    return args


def inference_config(args, cfg: Config, runtime, state: dict) -> Config:
    """The checkpoint's config with the flags applied, validated by config (its messages name the flag); with
    --batch auto, the most chunks per forward that fit the budget. What runs is this config: the features files
    store it, and the InferenceSpec is read from it."""
    cfg = apply_inference_flags(cfg, {"--chunk": args.chunk, "--overlap": args.overlap, "--agg": args.agg,
                                      "--batch": None if args.batch == "auto" else args.batch,
                                      "--sample-timeout": args.sample_timeout, "--head-window": args.head_window})
    if args.batch == "auto":
        batch = inference_batch_for_budget(cfg, runtime, DataShape.of_checkpoint(state), cfg.train.chunk_infer_size,
                                    args.memory_budget_gb)
        cfg = apply_inference_flags(cfg, {"--batch": batch})
    return cfg


def find_checkpoint(args) -> tuple[str, str]:
    """(checkpoint, why it was chosen): --checkpoint; the latest run of --config's experiment; or the most recently
    written best.pt of any experiment under --runs (the last one trained)."""
    if args.checkpoint:
        return args.checkpoint, "--checkpoint"
    if args.config:
        cfg = load_config(args.config)
        path = ExperimentDirectory.of_config(cfg).latest_best(f"--config {args.config}")
        return path, f"the latest run of experiment '{cfg.experiment}' ({args.config})"
    return most_recent_best(args.runs), (f"the most recently written best.pt under {args.runs}/ (--config or "
                                         f"--checkpoint to choose another)")


def print_result(result: dict, show_timeline: bool) -> None:
    top = ", ".join(f"{t['label']} {t['prob']:.2f}" for t in result["topk"])
    truth = f"  (true: {result['label']})" if "label" in result else ""
    print(f"{result['video']}: {result['num_frames']} frames @ {result['fps']:.1f} fps, {result['chunks']} chunks "
          f"-> {top}{truth}")
    if "scores" in result:
        print(f"  timeline against the annotated segments: {format_scores(result['scores'])}")
    if show_timeline:
        print(f"  {'start':>8s} {'end':>8s} {'start s':>8s} {'end s':>8s}  label")
        for seg in result["segments"]:
            print(f"  {seg['start']:8d} {seg['end']:8d} {seg['start'] / result['fps']:8.2f} "
                  f"{seg['end'] / result['fps']:8.2f}  {seg['label']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    quiet_decoder_logs()
    shard_index, shard_count = parse_shard(args.shard)
    if args.features:
        prepare_directory(args.features)
    checkpoint_path, why = find_checkpoint(args)
    device = resolve_device(args.device or "auto")
    model, cfg, class_names, state = load_trained_model(checkpoint_path, device, args.backbone)
    if "backbone" in state:
        why += f"; its backbone: {state['backbone']}"
    runtime = setup_runtime(cfg.trainer, device=str(device), precision=args.precision)
    cfg = inference_config(args, cfg, runtime, state)
    head_reach = set_temporal_window(model, cfg.model.temporal_window)
    spec = InferenceSpec.of_config(cfg.train, args.topk, args.timeline, args.decode_threads or None)
    source, records = resolve_inputs(args.input, cfg.data)
    if args.max_videos:
        records = records[:args.max_videos]
    names = feature_names(records)  # over the whole list: every shard names a file alike
    records, names = shard(records, shard_index, shard_count), shard(names, shard_index, shard_count)
    head = cfg.model.temporal_head
    aggregation = f"temporal head {head}, {head_reach}" if head != "none" else f"agg {spec.aggregation}"
    part = f", shard {shard_index}/{shard_count}" if shard_count > 1 else ""
    print(f"checkpoint: {checkpoint_path} ({why})\ninput: {source} ({len(records)} videos{part})\n"
          f"chunk {spec.chunk} overlap {spec.overlap} {aggregation} batch {spec.batch} on {runtime.device}")
    features = None
    if args.features:
        features = (FeatureSpec(args.features, args.features_dtype),
                    settings_of(cfg, spec.chunk, spec.overlap, args.features_dtype, file_sha256(checkpoint_path)),
                    checkpoint_path)
    if runtime.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(runtime.device)
    outputs = Outputs(args.output, args.plot, args.timeline, args.plot_row_minutes)
    failures = run_videos(model, records, names, cfg, spec, runtime, class_names, outputs, features)
    snap = memory_monitor.snapshot(runtime.device)
    peak = f", device peak {snap['device_peak_mb']:.0f} MB" if "device_peak_mb" in snap else ""
    print(f"peak memory: host RSS {memory_monitor.host_peak_rss_mb():.0f} MB{peak}")
    return 1 if failures else 0


def run_videos(model, records: list, names: list[str], cfg: Config, spec: InferenceSpec, runtime, class_names,
               outputs: Outputs, features: tuple | None) -> int:
    """Each video classified (and with ``features``, its features written, or skipped when already there);
    prints each result and the summary; returns the number that failed."""
    prepare = InputPreparer(runtime.device, cfg.data.mean, cfg.data.std)
    counts, correct, labelled, chunks, start = Counter(), 0, 0, 0, time.perf_counter()
    scores = SegmentationScores(background_indices(cfg.data.background_labels, class_names))
    outputs.start()
    for number, (record, name) in enumerate(zip(records, tqdm(names, desc="videos", disable=not
                                                              sys.stderr.isatty() or len(records) == 1))):
        path = os.path.join(features[0].directory, name) if features else None
        reason = done_before(path, features[1]) if features else "new"
        if reason is None:
            print(f"skipped {record.first_path}: {path} exists with the same settings")
            counts["skipped"] += 1
            continue
        try:
            result = classify_video(model, record, cfg.data, spec, runtime, prepare, class_names,
                                    keep_features=features is not None, scores=scores)
        except BAD_INPUT_ERRORS as e:
            if len(records) == 1:
                raise
            counts["failed"] += 1
            result = {"video": record.first_path, "error": str(e)}
            print(f"error: {e}", file=sys.stderr)
            if isinstance(e, StalledFile) and number + 1 < len(records):
                # OpenCV opens files under one process-wide lock, which the blocked decoder holds for good
                print(f"error: the other {len(records) - number - 1} videos are not run: a stalled file keeps "
                      f"the decoder blocked in this process; run infer_chunked.py again without it",
                      file=sys.stderr)
                counts["failed"] += len(records) - number - 1
                break
        if features and "error" not in result:
            chunks += len(result["features"])
            result = save_features(path, result, record, cfg, features, class_names, reason)
            counts["done"] += 1
        if "correct" in result:
            labelled += 1
            correct += int(result["correct"])
        outputs.write(result, name, class_names)
        if "error" not in result:  # the console shows the summary with --output too
            print_result(result, spec.timeline)
    if labelled:
        print(f"accuracy: {correct}/{labelled} = {correct / labelled:.4f}")
    if scores.videos:
        print(f"timelines over {scores.videos} annotated videos: {format_scores(scores.result())}")
        outputs.write_scores(scores.result(), scores.videos)
    if features:
        print(f"features: {counts['done']} done, {counts['skipped']} skipped (already there), {counts['failed']} "
              f"failed; {chunks / max(time.perf_counter() - start, 1e-9):.1f} chunks/s")
    return counts["failed"]


class Outputs:
    """What a run writes besides the console: --output's JSON lines (each appended whole) and, with --timeline, its
    per-frame CSV; --plot's pictures; the split's timeline scores."""

    def __init__(self, output: str | None, plot_dir: str | None, timeline: bool, row_minutes: float = ROW_MINUTES):
        self.output, self.plot_dir, self.row_minutes = output, plot_dir, row_minutes
        stem = os.path.splitext(output)[0] if output else None
        self.frames_csv = f"{stem}_frames.csv" if output and timeline else None
        self.scores_json = f"{stem}_scores.json" if output else None

    def start(self) -> None:
        if self.output:
            atomic_write_bytes(self.output, b"")  # this run's results only; each line is appended whole
        if self.frames_csv:
            atomic_write_bytes(self.frames_csv, b"video,frame,time_s,label,probability,true_label\n")
        if self.plot_dir:
            os.makedirs(self.plot_dir, exist_ok=True)

    def write(self, result: dict, name: str, class_names: list[str]) -> None:
        frames = result.pop("frames", None)
        if self.output:
            append_whole(self.output, (json.dumps(result) + "\n").encode())
        if frames is None:
            return
        if self.frames_csv:
            append_whole(self.frames_csv, frame_rows(result, frames, class_names).encode())
        if self.plot_dir:
            path = os.path.join(self.plot_dir, os.path.splitext(name)[0] + ".png")
            timeline_plot(path, frames.labels, frames.truth, class_names, result["fps"],
                          os.path.basename(str(result["video"])), result.get("scores"), self.row_minutes)
            print(f"  timeline picture: {path}")

    def write_scores(self, scores: dict, videos: int) -> None:
        if self.scores_json:
            atomic_write_bytes(self.scores_json, json.dumps({"videos": videos, **scores}, indent=1).encode())


def frame_rows(result: dict, frames, class_names: list[str]) -> str:
    """A video's per-frame CSV rows: frame, time, predicted label and its probability, the annotated label."""
    text, fps = io.StringIO(), result["fps"]
    writer = csv.writer(text, lineterminator="\n")
    for frame, (label, probability) in enumerate(zip(frames.labels, frames.probability)):
        true = "" if frames.truth is None or frames.truth[frame] < 0 else class_names[frames.truth[frame]]
        writer.writerow([result["video"], frame, f"{frame / fps:.3f}", class_names[label], f"{probability:.4f}", true])
    return text.getvalue()


def save_features(path: str, result: dict, record, cfg: Config, features: tuple, class_names, reason: str) -> dict:
    """A video's features file written (atomically); returns its result without the arrays, for the output line."""
    write_features(path, result, record, cfg, features[1], class_names, features[2])
    print(f"features: {path} ({len(result['features'])} chunks; {reason})")
    return {k: v for k, v in result.items() if k not in ("features", "chunk_logits", "frame_windows", "stride")}


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS + (CheckpointError,),
                        disk_advice="free space there and run the same command again: with --features, the videos "
                                    "whose files are written are skipped")
