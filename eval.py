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
import csv
import io
import json
import logging
from dataclasses import dataclass

import torch

from atomic_files import atomic_write_bytes
from checkpoint import CheckpointError, load_trained_model
from chunked_forward import AGGREGATIONS
from cli import exit_on_usage_error
from config import apply_flags
from datasets.video_dataset import BAD_INPUT_ERRORS, BadInputReport, build_dataset, index_cache_for
from datasets.transforms import InputPreparer
from metrics import ClassificationMeter
from runtime import resolve_device, setup_logging, setup_runtime
from train import cap_workers, evaluate, make_loader

log = logging.getLogger("longvideo")  # set up by main(): importing this module configures nothing


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--checkpoint", help="checkpoint to evaluate (loaded with weights_only=True)")
    target.add_argument("--watch", metavar="RUN_DIR",
                        help="evaluate every checkpoint under RUN_DIR (runs/<experiment> or one run) that has no "
                             "result in RUN_DIR/eval.jsonl yet, oldest first; safe to start from cron")
    parser.add_argument("--data", help="manifest to evaluate on (default: the checkpoint config's --split manifest)")
    parser.add_argument("--split", choices=("val", "test"), default="val", help="which manifest of the config")
    parser.add_argument("--chunk", type=int, help="frames per inference chunk (-1 = whole clip); "
                                                  "default train.chunk_infer_size")
    parser.add_argument("--overlap", type=int, help="frames shared by consecutive chunks")
    parser.add_argument("--agg", choices=AGGREGATIONS, help="chunk aggregation")
    parser.add_argument("--batch", type=int, help="inference chunks per forward call")
    parser.add_argument("--num-frames", type=int, help="frames per clip (-1 = the whole sample window)")
    parser.add_argument("--crops", type=int, help="spatial crops per clip: 1 (the centre) or 3 (along the long side, "
                                                  "each an evaluated clip; video accuracy averages them all)")
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--precision", help="32, 16, bf16 or amp (default: the checkpoint's)")
    parser.add_argument("--output", help="write OUTPUT.json (metrics), OUTPUT.csv (per-video predictions) and "
                                         "OUTPUT_clips.csv (per clip)")
    parser.add_argument("--interval", type=float, metavar="SECONDS", help="with --watch: repeat every SECONDS")
    parser.add_argument("--settle", type=float, default=5.0, metavar="SECONDS",
                        help="with --watch: leave checkpoints modified less than SECONDS ago for the next run")
    parser.add_argument("--plot", action="store_true", help="with --watch: write eval_history.png (needs matplotlib)")
    parser.add_argument("-v", "--verbose", action="store_true", help="with --watch: a line per checkpoint")
    args = parser.parse_args(argv)
    if args.checkpoint and (args.interval or args.plot):
        parser.error("--interval and --plot go with --watch")
    if args.watch and args.output:
        parser.error("--output goes with --checkpoint; --watch writes RUN_DIR/eval.jsonl")
    return args


def apply_overrides(cfg: dict, args: argparse.Namespace) -> dict:
    cfg = apply_flags(cfg, {"train.chunk_infer_size": ("--chunk", args.chunk),
                            "train.chunk_overlap": ("--overlap", args.overlap),
                            "train.chunk_aggregation": ("--agg", args.agg),
                            "train.video_batch_size": ("--batch", args.batch),
                            "data.num_frames": ("--num-frames", args.num_frames),
                            "data.test_crops": ("--crops", args.crops)})
    cap_workers(cfg["data"])
    return cfg


def evaluate_dataset(model, dataset, cfg: dict, runtime, class_names: list[str]) -> tuple[dict, list, list]:
    """(metrics, per-clip rows, per-video rows): train.py's evaluation loop with the rows eval.py writes.
    One sample per forward (long clips vary in length); predictions go to the CPU as they are made."""
    loader = make_loader(dataset, cfg, runtime, 1, shuffle=False, pad=False)
    prepare = InputPreparer(runtime.device, cfg["data"]["mean"], cfg["data"]["std"])
    meter, clip_rows, bad_inputs = ClassificationMeter(len(class_names)), [], BadInputReport(dataset)

    def add_clip_rows(batch, logits):
        for p, label, video, window in zip(logits.softmax(dim=1), batch["label"], batch["video_index"],
                                           batch["window"]):
            clip_rows.append({"video": _video_name(dataset, int(video)), "window_start": int(window[0]),
                              "window_end": int(window[1]), "label": class_names[int(label)],
                              "predicted": class_names[int(p.argmax())], "probability": round(float(p.max()), 6)})

    metrics = evaluate(model, loader, prepare, runtime, cfg["train"], len(class_names), bad_inputs, meter,
                       add_clip_rows)
    bad_inputs.end_run()
    video_rows = [{"video": _video_name(dataset, v["video_index"]), "label": class_names[v["label"]],
                   "predicted": class_names[v["predicted"]], "probability": round(v["probability"], 6),
                   "clips": v["clips"]} for v in meter.video_predictions()]
    return metrics, clip_rows, video_rows


def _video_name(dataset, video_index: int) -> str:
    return ";".join(dataset.records[video_index].views.values())


def format_report(metrics: dict, class_names: list[str]) -> str:
    top5 = f"top-5 {metrics['top5']:.4f}" if len(class_names) > 5 else "top-5 n/a (5 classes or fewer)"
    lines = [f"top-1 clip acc {metrics['clip_acc']:.4f}  {top5}  "
             f"video-level acc {metrics.get('video_acc', float('nan')):.4f}  mean class acc "
             f"{metrics['mean_class_acc']:.4f}  ({metrics['num_clips']} clips, {metrics.get('num_videos', 0)} videos)",
             f"{'class':>16s} {'precision':>9s} {'recall':>9s} {'f1':>9s}"]
    for i, name in enumerate(class_names):
        lines.append(f"{name:>16s} {metrics['precision'][i]:9.4f} {metrics['recall'][i]:9.4f} {metrics['f1'][i]:9.4f}")
    width = max(6, max(len(n) for n in class_names))
    lines.append("confusion matrix (rows: true, columns: predicted)")
    lines.append(" " * (width + 1) + " ".join(f"{n[:width]:>{width}s}" for n in class_names))
    for name, row in zip(class_names, metrics["confusion"]):
        lines.append(f"{name[:width]:>{width}s} " + " ".join(f"{v:>{width}d}" for v in row))
    return "\n".join(lines)


def write_outputs(prefix: str, metrics: dict, clip_rows: list[dict], video_rows: list[dict], info: dict) -> None:
    atomic_write_bytes(prefix + ".json", json.dumps({**info, "metrics": metrics}, indent=1).encode())
    for path, rows in ((prefix + ".csv", video_rows), (prefix + "_clips.csv", clip_rows)):
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["video"])
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(path, text.getvalue().encode())


@dataclass
class EvaluationResult:
    """One checkpoint evaluated: its metrics, the config used, its class names and checkpoint dict, the rows."""
    metrics: dict
    cfg: dict
    class_names: list
    state: dict
    clip_rows: list
    video_rows: list


def evaluate_checkpoint(path: str, args: argparse.Namespace) -> EvaluationResult:
    device = resolve_device(args.device or "auto")
    model, cfg, class_names, state = load_trained_model(path, device)
    cfg = apply_overrides(cfg, args)
    runtime = setup_runtime(cfg["trainer"], device=str(device), precision=args.precision)
    dataset = build_dataset(cfg, args.split, class_names, training=False, manifest=args.data,
                            index_cache=index_cache_for(cfg))
    metrics, clip_rows, video_rows = evaluate_dataset(model, dataset, cfg, runtime, class_names)
    del model
    if runtime.device.type == "cuda":
        torch.cuda.empty_cache()  # the next checkpoint starts from a clean device
    return EvaluationResult(metrics, cfg, class_names, state, clip_rows, video_rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    if args.watch:
        from eval_watch import WatchSpec, watch
        spec = WatchSpec(args.watch, args.interval, args.settle, args.plot, args.verbose, args.data or args.split)
        return watch(spec, lambda path: evaluate_checkpoint(path, args))
    result = evaluate_checkpoint(args.checkpoint, args)
    metrics, cfg, class_names, state = result.metrics, result.cfg, result.class_names, result.state
    clip_rows, video_rows = result.clip_rows, result.video_rows
    train = cfg["train"]
    print(f"{args.checkpoint} (epoch {state.get('epoch')}, step {state.get('global_step')}) on "
          f"{args.data or args.split}: chunk {train['chunk_infer_size']} overlap {train['chunk_overlap']} "
          f"agg {train['chunk_aggregation']}")
    print(format_report(metrics, class_names))
    if args.output:
        info = {"checkpoint": args.checkpoint, "data": args.data or args.split, "class_names": class_names}
        write_outputs(args.output, metrics, clip_rows, video_rows, info)
        print(f"wrote {args.output}.json, {args.output}.csv (per video) and {args.output}_clips.csv (per clip)")
    return 0


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS + (CheckpointError,))
