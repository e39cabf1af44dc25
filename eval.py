"""Evaluate a checkpoint with the same chunked forward as training.

    python eval.py --checkpoint runs/quickstart/latest/checkpoints/best.pt --split val
    python eval.py --checkpoint best.pt --data my_test.jsonl --chunk 32 --overlap 8 --agg prob --output results

    python eval.py --watch runs/quickstart            # from cron: each new checkpoint once -> eval.jsonl
    python eval.py --watch runs/quickstart --interval 600   # the same in a loop, without cron

Config defaults come from the checkpoint; flags override. Prints top-1, top-5, per-class
precision/recall/F1, clip- and video-level accuracy and the confusion matrix; with --output, writes
PREFIX.json (metrics), PREFIX.csv (one row per video: label, prediction, probability, clips) and
PREFIX_clips.csv (one row per clip: video, window, label, prediction, probability).

This file holds one evaluation (``evaluate_checkpoint``: the model, the split, the evaluation loop that training's
validation runs too, the report) and the cron watcher's pass (``watch_pass``); the checkpoint's loading, the
dataset, the ledger and its lock are calls.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from artifacts.checkpoint import CheckpointError
from artifacts.ledger import append_ledger, read_ledger
from artifacts.run_dir import WatchedDirectory
from artifacts.trained_model import load_trained_model
from config import add_inference_flags, apply_inference_flags, derive, inference_overrides
from core.cli import exit_on_usage_error
from core.files import file_sha256
from core.logs import setup_logging
from core.runtime import resolve_device, setup_runtime
from datasets.bad_input import BAD_INPUT_ERRORS, BadInputReport
from datasets.device_input import DeviceInputs
from datasets.video.capture import quiet_decoder_logs
from datasets.video_dataset import build_dataset, index_cache_for
from engine.data.loaders import cap_workers, make_loader
from engine.evaluation.evaluate import (
    EvaluationResult,
    evaluate_dataset,
    evaluate_on_features,
    format_report,
    write_outputs,
)
from engine.evaluation.watch import WatchPass, WatchSpec, watch
from engine.inference.stream import how_it_runs
from engine.training.chunked_forward import ChunkedTrainingForward
from engine.training.motion_pretext import MotionPretextForward, evaluate_motion
from models import set_head_chunks
from planner.batch_size import inference_batch_for_budget

log = logging.getLogger("longvideo")
# --whole-videos: a video is one sample window, streamed whole (no clip drawn from it), in one crop: the samples
# and chunks of infer_chunked.py
WHOLE_VIDEOS = {"data.max_video_frames": None, "data.num_frames": -1, "data.test_clips": 1, "data.test_crops": 1}


@dataclass(frozen=True)
class EvaluationSpec:
    """What a checkpoint is evaluated on, and how: ``overrides`` of the checkpoint config's keys, each with the flag
    that set it, for the errors ({"infer.chunk_size": ("--chunk", 32)}: config.inference_overrides)."""

    split: str = "val"
    data: str | None = None  # a manifest instead of the config's split
    device: str | None = None
    precision: str | None = None
    batch_auto: bool = False  # --batch auto: the most chunks per forward the memory budget holds
    memory_budget_gb: float | None = None  # --memory-budget-gb: the budget of --batch auto, else the config's
    overrides: dict = field(default_factory=dict)
    backbone: str | None = None  # a head trained on features: its backbone checkpoint, if not where it was
    whole_videos: bool = False  # --whole-videos: each video one sample, streamed whole (WHOLE_VIDEOS)


def evaluate_checkpoint(path: str, spec: EvaluationSpec) -> EvaluationResult:
    """One evaluation: the checkpoint's model and config (the flags applied), its split's clips through the chunked
    forward of training's validation (``evaluate_dataset``), and the rows eval.py writes."""
    device = resolve_device(spec.device or "auto")
    model, cfg, class_names, checkpoint = load_trained_model(path, device, spec.backbone)
    if checkpoint.features is not None:  # a head on the features its dataset came with: scored on those
        return evaluate_on_features(path, model, cfg, class_names, checkpoint, spec.precision, spec)
    cfg = cap_workers(apply_inference_flags(cfg, spec.overrides))
    if spec.whole_videos:
        cfg = derive(cfg, WHOLE_VIDEOS, "--whole-videos")
    head_reach = set_head_chunks(model, cfg.infer.head_chunks)
    runtime = setup_runtime(cfg.trainer, device=str(device), precision=spec.precision)
    if spec.batch_auto:  # every evaluated clip of a window (clips x crops) goes through each forward
        clips = cfg.data.test_clips * cfg.data.test_crops
        batch = inference_batch_for_budget(cfg, runtime, checkpoint.shape, spec.memory_budget_gb, clips)
        cfg = apply_inference_flags(cfg, {"infer.chunks_per_forward": ("--batch auto", batch)})
    dataset = build_dataset(
        cfg, spec.split, class_names, training=False, manifest=spec.data, index_cache=index_cache_for(cfg)
    )
    if cfg.train.objective == "motion":  # a backbone pretrained without labels: its objective, no label read
        metrics, clip_rows, video_rows = evaluate_pretext(model, dataset, cfg, runtime), [], []
    else:
        metrics, clip_rows, video_rows = evaluate_dataset(model, dataset, cfg, runtime, class_names)
    del model
    if runtime.device.type == "cuda":
        torch.cuda.empty_cache()  # the next checkpoint starts from a clean device
    return EvaluationResult(metrics, cfg, class_names, checkpoint, clip_rows, video_rows, head_reach)


def evaluate_pretext(model, dataset, cfg, runtime) -> dict:
    """train.objective: motion's validation (``evaluate_motion``) on ``dataset``'s clips, its labels unread: the
    same patches as the run's validation pasted, in the training chunks the run had."""
    loader = make_loader(dataset, cfg.data, cfg.train.seed, runtime, 1, shuffle=False, pad=False)
    inputs = DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std)
    forward = MotionPretextForward(ChunkedTrainingForward(model, inputs.normalize, cfg.data.frame_stride))
    bad_inputs = BadInputReport(dataset)
    metrics = evaluate_motion(forward, loader, inputs, runtime, cfg.train.chunk_train_size, cfg.train.seed, bad_inputs)
    bad_inputs.end_run()
    return metrics


def summary(metrics: dict) -> str:
    """A checkpoint's evaluation in a few words, for the watcher's log."""
    if "direction_acc" in metrics:
        return f"direction acc {metrics['direction_acc']:.4f} loss {metrics['loss']:.4f}"
    return f"top-1 {metrics['clip_acc']:.4f} video acc {metrics.get('video_acc', float('nan')):.4f}"


def watch_pass(watched: WatchSpec, spec: EvaluationSpec) -> WatchPass:
    """The cron watcher's pass over a run's checkpoints, oldest first: each new one (by the SHA-256 of its content)
    evaluated and its line appended to eval.jsonl; one still being written (modified less than --settle seconds
    ago, or changing while hashed) left for the next pass; one that cannot be loaded recorded as failed, not
    retried until its content changes."""
    run_dir, directory = watched.run_dir, WatchedDirectory(watched.run_dir)
    done = {entry.get("sha256") for entry in read_ledger(directory.ledger)}
    evaluated = failed = skipped = waiting = 0
    for path in directory.checkpoints():
        relative = os.path.relpath(path, run_dir)
        try:
            before = os.stat(path)
            if time.time() - before.st_mtime < watched.settle:
                log.info("%s: modified %.1f s ago; left for the next run", relative, time.time() - before.st_mtime)
                waiting += 1
                continue
            digest = file_sha256(path)
            after = os.stat(path)
        except FileNotFoundError:  # replaced or deleted since listed (keep_last_k): nothing to evaluate
            continue
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            log.info("%s: changing while read; left for the next run", relative)
            waiting += 1
            continue
        if digest in done:
            skipped += 1
            continue
        start = time.perf_counter()
        entry = {"checkpoint": relative, "sha256": digest, "size": after.st_size, "split": watched.split}
        try:
            result = evaluate_checkpoint(path, spec)
        except CheckpointError as e:  # a property of this file: recorded, not retried until it changes
            entry.update(status="failed", error=str(e))
            log.warning("%s: %s", relative, e)
            failed += 1
        else:
            metrics, saved = result.metrics, result.checkpoint
            entry.update(
                status="ok",
                epoch=saved.epoch,
                global_step=saved.global_step,
                metrics=metrics,
                class_names=result.class_names,
            )
            log.info("%s: epoch %s step %s %s", relative, saved.epoch, saved.global_step, summary(metrics))
            evaluated += 1
        entry.update(seconds=round(time.perf_counter() - start, 3), time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        append_ledger(directory.ledger, entry)
        done.add(digest)
    return WatchPass(evaluated, failed, skipped, waiting)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--checkpoint", help="checkpoint to evaluate (loaded with weights_only=True)")
    target.add_argument(
        "--watch",
        metavar="RUN_DIR",
        help="evaluate every checkpoint under RUN_DIR (runs/<experiment> or one run) that has no "
        "result in RUN_DIR/eval.jsonl yet, oldest first; safe to start from cron",
    )
    parser.add_argument("--data", help="manifest to evaluate on (default: the checkpoint config's --split manifest)")
    parser.add_argument("--split", choices=("val", "test"), default="val", help="which manifest of the config")
    add_inference_flags(parser, clips=True)
    parser.add_argument(
        "--whole-videos",
        action="store_true",
        help="each video one sample streamed whole in inference chunks: its prediction is infer_chunked.py's "
        "for it (without this flag, a video's is the mean of its sample windows' clips, as training validates)",
    )
    parser.add_argument(
        "--output",
        help="write OUTPUT.json (metrics), OUTPUT.csv (per-video predictions) and OUTPUT_clips.csv (per clip)",
    )
    parser.add_argument("--interval", type=float, metavar="SECONDS", help="with --watch: repeat every SECONDS")
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="with --watch: leave checkpoints modified less than SECONDS ago for the next run",
    )
    parser.add_argument(
        "--lock-limit",
        type=float,
        default=7200.0,
        metavar="SECONDS",
        help="with --watch: a lock held longer than this by another evaluation is reported (who, "
        "since when, how to clear it) with exit code 1, instead of skipping quietly",
    )
    parser.add_argument("--plot", action="store_true", help="with --watch: write eval_history.png (needs matplotlib)")
    parser.add_argument("-v", "--verbose", action="store_true", help="with --watch: a line per checkpoint")
    args = parser.parse_args(argv)
    if args.checkpoint and (args.interval or args.plot):
        parser.error("--interval and --plot go with --watch")
    if args.watch and args.output:
        parser.error("--output goes with --checkpoint; --watch writes RUN_DIR/eval.jsonl")
    if args.whole_videos and any(v is not None for v in (args.num_frames, args.clips, args.crops)):
        parser.error("--whole-videos streams each video whole: leave out --num-frames, --clips and --crops")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    quiet_decoder_logs(args.verbose)
    spec = EvaluationSpec(
        args.split,
        args.data,
        args.device,
        args.precision,
        batch_auto=args.batch == "auto",
        memory_budget_gb=args.memory_budget_gb,
        overrides=inference_overrides(args),
        whole_videos=args.whole_videos,
        backbone=args.backbone,
    )
    if args.watch:
        watched = WatchSpec(
            args.watch, args.interval, args.settle, args.plot, args.verbose, args.data or args.split, args.lock_limit
        )
        return watch(watched, lambda: watch_pass(watched, spec))
    result = evaluate_checkpoint(args.checkpoint, spec)
    saved = result.checkpoint
    where = f"{args.checkpoint} (epoch {saved.epoch}, step {saved.global_step}) on {args.data or args.split}"
    if "direction_acc" in result.metrics:  # a backbone pretrained without labels (train.objective: motion)
        metrics = result.metrics
        print(
            f"{where}: {summary(metrics)}: the pasted motion's direction read within 22.5 degrees (chance 0.125) in "
            f"{metrics['num_chunks']} training chunks of {metrics['num_clips']} clips"
        )
    else:
        print(f"{where}: {how_it_runs(result.cfg, result.head_reach)}")
        print(format_report(result.metrics, result.class_names))
    if args.output:
        info = {"checkpoint": args.checkpoint, "data": args.data or args.split, "class_names": result.class_names}
        write_outputs(args.output, result.metrics, result.clip_rows, result.video_rows, info)
        print(f"wrote {args.output}.json, {args.output}.csv (per video) and {args.output}_clips.csv (per clip)")
    return 0


if __name__ == "__main__":
    exit_on_usage_error(
        main,
        BAD_INPUT_ERRORS + (CheckpointError,),
        disk_advice="free space there and run it again: with --watch, the checkpoints already in "
        "eval.jsonl are not evaluated again",
    )
