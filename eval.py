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
from config import add_head_window_flag
from core.cli import exit_on_usage_error
from core.errors import ConfigError
from core.logs import setup_logging
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.video.capture import quiet_decoder_logs
from engine.chunking import AGGREGATIONS
from engine.evaluate import EvaluationSpec, evaluate_checkpoint, format_report, write_outputs
from engine.watch import WatchSpec, watch
from planner.batch_size import inference_batch_for_budget


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--checkpoint", help="checkpoint to evaluate (loaded with weights_only=True)")
    target.add_argument("--watch", metavar="RUN_DIR",
                        help="evaluate every checkpoint under RUN_DIR (runs/<experiment> or one run) that has no "
                             "result in RUN_DIR/eval.jsonl yet, oldest first; safe to start from cron")
    parser.add_argument("--backbone", metavar="PATH",
                        help="a temporal head trained on features (data.features_dir) runs with the backbone "
                             "checkpoint that wrote them, found where it was; give it here if it moved (its sha256 "
                             "is checked)")
    parser.add_argument("--data", help="manifest to evaluate on (default: the checkpoint config's --split manifest)")
    parser.add_argument("--split", choices=("val", "test"), default="val", help="which manifest of the config")
    parser.add_argument("--chunk", type=int, help="frames per inference chunk (-1 = whole clip); "
                                                  "default train.chunk_infer_size")
    parser.add_argument("--overlap", type=int, help="frames shared by consecutive chunks")
    parser.add_argument("--agg", choices=AGGREGATIONS, help="chunk aggregation")
    add_head_window_flag(parser)
    parser.add_argument("--batch", metavar="N|auto",
                        help="inference chunks per forward call, for all the views of a window at once; auto = the "
                             "most whose estimated device memory fits --memory-budget-gb (the memory planner)")
    parser.add_argument("--memory-budget-gb", type=float,
                        help="the memory --batch auto fits (default: the checkpoint's trainer.memory_budget_gb)")
    parser.add_argument("--num-frames", type=int, help="frames per clip (-1 = the whole sample window)")
    parser.add_argument("--crops", type=int, help="spatial crops per clip: 1 (the centre) or 3 (along the long side, "
                                                  "each an evaluated clip; video accuracy averages them all)")
    parser.add_argument("--sample-timeout", type=float, metavar="SECONDS",
                        help="seconds a sample may take to load before it counts as a bad video (default: the "
                             "checkpoint's data.sample_timeout_s)")
    parser.add_argument("--clips", type=int, help="temporal clips per sample window, evenly spaced (data.test_clips), "
                                                  "each times --crops: --clips 10 --crops 3 is the 30-view protocol")
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--precision", help="32, 16, bf16 or amp (default: the checkpoint's)")
    parser.add_argument("--output", help="write OUTPUT.json (metrics), OUTPUT.csv (per-video predictions) and "
                                         "OUTPUT_clips.csv (per clip)")
    parser.add_argument("--interval", type=float, metavar="SECONDS", help="with --watch: repeat every SECONDS")
    parser.add_argument("--settle", type=float, default=5.0, metavar="SECONDS",
                        help="with --watch: leave checkpoints modified less than SECONDS ago for the next run")
    parser.add_argument("--lock-limit", type=float, default=7200.0, metavar="SECONDS",
                        help="with --watch: a lock held longer than this by another evaluation is reported (who, "
                             "since when, how to clear it) with exit code 1, instead of skipping quietly")
    parser.add_argument("--plot", action="store_true", help="with --watch: write eval_history.png (needs matplotlib)")
    parser.add_argument("-v", "--verbose", action="store_true", help="with --watch: a line per checkpoint")
    args = parser.parse_args(argv)
    if args.checkpoint and (args.interval or args.plot):
        parser.error("--interval and --plot go with --watch")
    if args.watch and args.output:
        parser.error("--output goes with --checkpoint; --watch writes RUN_DIR/eval.jsonl")
    return args


def evaluation_spec(args: argparse.Namespace) -> EvaluationSpec:
    auto = args.batch == "auto"
    flags = {"--chunk": args.chunk, "--overlap": args.overlap, "--agg": args.agg,
             "--batch": None if auto or args.batch is None else parse_count("--batch", args.batch),
             "--num-frames": args.num_frames, "--crops": args.crops, "--clips": args.clips,
             "--sample-timeout": args.sample_timeout, "--head-window": args.head_window}
    batch_for_budget = None
    if auto:
        def batch_for_budget(cfg, shape, runtime):
            test_views = cfg.data.test_clips * cfg.data.test_crops  # clips x crops, not camera views
            chunk = cfg.train.chunk_infer_size
            chunks = inference_batch_for_budget(cfg, runtime, shape, chunk, args.memory_budget_gb)
            return max(1, chunks // test_views)  # each forward holds every test view of the window
    return EvaluationSpec(args.split, args.data, args.device, args.precision, fit_batch=batch_for_budget, flags=flags,
                          backbone=args.backbone)


def parse_count(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text}: expected a number of chunks, or auto")


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    quiet_decoder_logs(args.verbose)
    spec = evaluation_spec(args)
    if args.watch:
        watched = WatchSpec(args.watch, args.interval, args.settle, args.plot, args.verbose, args.data or args.split,
                            args.lock_limit)
        return watch(watched, lambda path: evaluate_checkpoint(path, spec))
    result = evaluate_checkpoint(args.checkpoint, spec)
    train, state = result.cfg.train, result.state
    head = result.cfg.model.temporal_head
    aggregation = f"temporal head {head}, {result.head_reach}" if head != "none" else f"agg {train.chunk_aggregation}"
    print(f"{args.checkpoint} (epoch {state.get('epoch')}, step {state.get('global_step')}) on "
          f"{args.data or args.split}: chunk {train.chunk_infer_size} overlap {train.chunk_overlap} "
          f"{aggregation}")
    print(format_report(result.metrics, result.class_names))
    if args.output:
        info = {"checkpoint": args.checkpoint, "data": args.data or args.split, "class_names": result.class_names}
        write_outputs(args.output, result.metrics, result.clip_rows, result.video_rows, info)
        print(f"wrote {args.output}.json, {args.output}.csv (per video) and {args.output}_clips.csv (per clip)")
    return 0


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS + (CheckpointError,),
                        disk_advice="free space there and run it again: with --watch, the checkpoints already in "
                                    "eval.jsonl are not evaluated again")
