"""Timelines: per-chunk classification against a temporal model over whole videos, on the same videos, scored as the
temporal action segmentation field scores them.

    python -m bench.timelines                     # 48 + 16 videos of 600 frames at 64x64, tiny3d width 64 (16 min)
    python -m bench.timelines --size 32 --width 16  # configs/timelines.yaml's own shape (5 minutes)
    python -m bench.timelines --part sampled --size 32 --width 16   # end to end: every chunk vs train.grad_chunks 4

The speed ratio is the features path's point and depends on the backbone's cost, which end to end pays every epoch
and the features path once: a tiny backbone (the preset's tiny3d at 32x32) leaves per-operation overhead to
dominate both, so the default is a larger (still small) one.

Data: ``python -m datasets.synthetic --segmentation`` (written to data/segmentation if missing): each segment's label
is its look and the look of the segment before it, so no single chunk can tell it (datasets/segmentation_task.py).
Variants, all from configs/timelines.yaml (tiny3d, 300 clip frames at stride 2 in chunks of 8: 38 chunks a video):

    per-chunk            the backbone trained end to end with dense chunk labels, no head (today's timeline)
    features + tcn       that backbone's features written once (infer_chunked.py --features), MS-TCN trained on them
    features + transf.   the same with model.temporal_head: transformer
    end to end + transf. the backbone and a transformer head trained together, chunked (every chunk recomputed)

Printed per variant: the validation timeline scores of the best epoch by F1@50 (frame accuracy, edit, F1@10/25/50),
the seconds of an epoch's training (the training videos over metrics.csv's training speed) and of a whole epoch
(elapsed time over epochs: validation and checkpoints included), each against the end-to-end run's; the planner's
estimate of one training step's peak (device memory at the run's batch; ``planner.estimate``) and the run's peak host
RSS (memory.csv). The features variants' times leave out writing the features (once, by the per-chunk backbone:
one inference pass over the videos).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile

from config import load_config
from datasets.segmentation_task import SEGMENT_CLASSES, generate_segmentation
from engine.data.feature_files import index_features
from planner.features import feature_training_estimate
from planner.project import config_training_estimate
from train import STEP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(
    out: str, experiment: str, overrides: list[str], config: str = "configs/timelines.yaml", videos: int = 48
) -> dict:
    command = [
        sys.executable,
        "train.py",
        "--config",
        config,
        "--set",
        f"trainer.output_dir={out}",
        "--set",
        f"experiment={experiment}",
    ] + [item for o in overrides for item in ("--set", o)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    run = os.path.join(out, experiment, "latest")
    with open(os.path.join(run, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    with open(os.path.join(run, "memory.csv"), newline="") as f:
        rss = max(float(r["host_rss_mb"]) for r in csv.DictReader(f))
    best = max(rows, key=lambda r: float(r["val_seg_f1@50"]))
    elapsed = [float(r["elapsed_s"]) for r in rows]
    return {
        "scores": {k: float(best[f"val_seg_{k}"]) for k in ("frame_acc", "edit", "f1@10", "f1@25", "f1@50")},
        "epoch": int(best["epoch"]),
        "epoch_s": (elapsed[-1] - elapsed[0]) / max(len(rows) - 1, 1),
        # the training part of an epoch: the training videos over its training speed (no validation, no saving)
        "train_s": sum(videos / float(r["train_clips_per_s"]) for r in rows) / len(rows),
        "rss_mb": rss,
        "checkpoint": os.path.join(run, "checkpoints", "best.pt"),
    }


def write_features(backbone: str, data: str, features: str) -> None:
    for split in ("train", "val"):
        command = [
            sys.executable,
            "infer_chunked.py",
            "--checkpoint",
            backbone,
            "--input",
            os.path.join(data, f"seg_{split}.jsonl"),
            "--features",
            features,
        ]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.timelines", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default=os.path.join(ROOT, "data", "segmentation"))
    parser.add_argument("--backbone-epochs", type=int, default=6, help="per-chunk and end-to-end runs")
    parser.add_argument("--head-epochs", type=int, default=40, help="the heads trained on features")
    parser.add_argument("--size", type=int, default=64, help="frame size (written and trained)")
    parser.add_argument("--width", type=int, default=64, help="tiny3d's width")
    parser.add_argument(
        "--part",
        choices=("variants", "sampled"),
        default="variants",
        help="variants: the four above; sampled: end to end + transformer with every chunk's gradient against "
        "train.grad_chunks K, over --seeds",
    )
    parser.add_argument("--grad-chunks", type=int, default=4, help="--part sampled: K")
    parser.add_argument("--seeds", default="0,1,2", help="--part sampled: train.seed values, comma-separated")
    parser.add_argument(
        "--rows",
        default="all,sampled,bank",
        help="--part sampled: every chunk (all), train.grad_chunks K (sampled), K with train.feature_bank (bank)",
    )
    parser.add_argument("--set", action="append", default=[], help="a config change for every run (KEY=VALUE)")
    args = parser.parse_args()
    data = generate_segmentation(f"{args.data}-{args.size}", size=args.size, quiet=True)
    shape = [f"data.data_dir={data}", f"data.img_size={args.size}", f"model.width={args.width}", *args.set]
    if args.part == "sampled":
        sampled(args, shape)
        return
    cfg = load_config(os.path.join(ROOT, "configs", "timelines.yaml"), shape)
    print(
        f"timeline task ({data}): 48 training and 16 validation videos of 600 frames at {args.size}x{args.size}, "
        f"{len(SEGMENT_CLASSES)} classes; tiny3d width {args.width}; on the CPU ({os.cpu_count()} CPUs)"
    )
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        epochs = f"train.max_epochs={args.backbone_epochs}"
        rows["per-chunk"] = train(out, "per_chunk", shape + [epochs])
        rows["per-chunk"]["peak"] = config_training_estimate(
            cfg, STEP, 300, cfg.data.batch_size, len(SEGMENT_CLASSES)
        ).peak
        features = os.path.join(out, "features")
        write_features(rows["per-chunk"]["checkpoint"], data, features)
        files, source = index_features(features)
        chunks = max(header["chunks"] for _, header in files.values())
        for head in ("tcn", "transformer"):
            overrides = shape + [
                f"data.features_dir={features}",
                f"model.temporal_head={head}",
                f"train.max_epochs={args.head_epochs}",
            ]
            rows[f"features + {head}"] = train(out, f"features_{head}", overrides, "configs/timelines-head.yaml")
            head_cfg = load_config(os.path.join(ROOT, "configs", "timelines-head.yaml"), overrides)
            rows[f"features + {head}"]["peak"] = feature_training_estimate(
                head_cfg, STEP, source["feature_dim"], chunks, head_cfg.data.batch_size, len(SEGMENT_CLASSES)
            ).peak
        e2e = shape + [epochs, "model.temporal_head=transformer"]
        rows["end to end + transformer"] = train(out, "end_to_end", e2e)
        e2e_cfg = load_config(os.path.join(ROOT, "configs", "timelines.yaml"), e2e)
        rows["end to end + transformer"]["peak"] = config_training_estimate(
            e2e_cfg, STEP, 300, e2e_cfg.data.batch_size, len(SEGMENT_CLASSES)
        ).peak
    end_to_end = rows["end to end + transformer"]
    print(
        f"{'variant':26s} {'frame acc':>9s} {'edit':>6s} {'F1@10':>6s} {'F1@25':>6s} {'F1@50':>6s} {'best ep':>7s} "
        f"{'train s/ep':>10s} {'vs e2e':>7s} {'s/epoch':>8s} {'vs e2e':>7s} {'step MiB':>8s} {'RSS MB':>7s}"
    )
    for name, row in rows.items():
        s = row["scores"]
        print(
            f"{name:26s} {s['frame_acc']:9.3f} {s['edit']:6.1f} {s['f1@10']:6.1f} {s['f1@25']:6.1f} "
            f"{s['f1@50']:6.1f} {row['epoch']:7d} {row['train_s']:10.2f} "
            f"{end_to_end['train_s'] / row['train_s']:6.1f}x {row['epoch_s']:8.2f} "
            f"{end_to_end['epoch_s'] / row['epoch_s']:6.1f}x {row['peak'] / 2**20:8.1f} {row['rss_mb']:7.0f}",
            flush=True,
        )


def sampled(args, shape: list[str]) -> None:
    """End to end + transformer (38 chunks a video): every chunk's gradient against train.grad_chunks K, each seed."""
    seeds = [int(v) for v in args.seeds.split(",")]
    print(
        f"timeline task, end to end + transformer head, tiny3d width {args.width} at {args.size}x{args.size}, 38 "
        f"training chunks a video, {args.backbone_epochs} epochs, seeds {seeds}; on the CPU ({os.cpu_count()} CPUs); "
        f"scores of the best epoch by F1@50"
    )
    print(
        f"{'train.grad_chunks':18s} {'F1@50':>6s} {'edit':>6s} {'frame acc':>9s} {'train s/ep':>10s}  F1@50, edit a seed"
    )
    base = shape + [f"train.max_epochs={args.backbone_epochs}", "model.temporal_head=transformer"]
    with tempfile.TemporaryDirectory() as out:
        sampled_rows = {
            "all": ("all", []),
            "sampled": (str(args.grad_chunks), [f"train.grad_chunks={args.grad_chunks}"]),
            # the bank needs one chunk grid: 300 clip frames (the whole 600-frame video at stride 2, less its last)
            "bank": (
                f"{args.grad_chunks} + bank",
                [f"train.grad_chunks={args.grad_chunks}", "train.feature_bank=host", "data.num_frames=300"],
            ),
        }
        for name, extra in (sampled_rows[row] for row in args.rows.split(",")):
            experiment = f"sampled_{name.replace(' + ', '_')}"
            runs = [train(out, f"{experiment}_{seed}", base + extra + [f"train.seed={seed}"]) for seed in seeds]
            mean = {k: sum(r["scores"][k] for r in runs) / len(runs) for k in ("f1@50", "edit", "frame_acc")}
            each = "; ".join(f"{r['scores']['f1@50']:.1f}, {r['scores']['edit']:.1f}" for r in runs)
            print(
                f"{name:18s} {mean['f1@50']:6.1f} {mean['edit']:6.1f} {mean['frame_acc']:9.3f} "
                f"{sum(r['train_s'] for r in runs) / len(runs):10.2f}  {each}",
                flush=True,
            )


if __name__ == "__main__":
    main()
