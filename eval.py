"""Evaluate a checkpoint with the same chunked forward as training.

    python eval.py --checkpoint runs/quickstart/latest/checkpoints/best.pt --split val
    python eval.py --checkpoint best.pt --data my_test.jsonl --chunk 32 --overlap 8 --agg prob --output results

    python eval.py --watch runs/quickstart            # from cron: each new checkpoint once -> eval.jsonl
    python eval.py --watch runs/quickstart --interval 600   # the same in a loop, without cron

Config defaults come from the checkpoint; flags override. Prints top-1, top-5, per-class
precision/recall/F1, clip- and video-level accuracy and the confusion matrix; with --output, writes
PREFIX.json (metrics), PREFIX.csv (one row per video: label, prediction, probability, clips) and
PREFIX_clips.csv (one row per clip: video, window, label, prediction, probability).
"""

from __future__ import annotations

import argparse

from artifacts.checkpoint import CheckpointError
from config import add_inference_flags, inference_overrides
from core.cli import exit_on_usage_error
from core.logs import setup_logging
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.video.capture import quiet_decoder_logs
from engine.evaluation.evaluate import EvaluationSpec, evaluate_checkpoint, format_report, write_outputs
from engine.evaluation.watch import WatchSpec, watch
from engine.inference.stream import how_it_runs
from planner.batch_size import inference_batch_for_budget


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
    return args


def evaluation_spec(args: argparse.Namespace) -> EvaluationSpec:
    batch_for_budget = None
    if args.batch == "auto":

        def batch_for_budget(cfg, shape, runtime):  # every evaluated clip of a window (clips x crops) in each forward
            clips = cfg.data.test_clips * cfg.data.test_crops
            return inference_batch_for_budget(cfg, runtime, shape, args.memory_budget_gb, clips)

    return EvaluationSpec(
        args.split,
        args.data,
        args.device,
        args.precision,
        fit_batch=batch_for_budget,
        overrides=inference_overrides(args),
        backbone=args.backbone,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    quiet_decoder_logs(args.verbose)
    spec = evaluation_spec(args)
    if args.watch:
        watched = WatchSpec(
            args.watch, args.interval, args.settle, args.plot, args.verbose, args.data or args.split, args.lock_limit
        )
        return watch(watched, lambda path: evaluate_checkpoint(path, spec))
    result = evaluate_checkpoint(args.checkpoint, spec)
    saved = result.checkpoint
    print(
        f"{args.checkpoint} (epoch {saved.epoch}, step {saved.global_step}) on "
        f"{args.data or args.split}: {how_it_runs(result.cfg, result.head_reach)}"
    )
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
