"""Normalization at small batches: model.norm and precise BN on the demo data at batch 2 in chunks of 8 frames.

    python -m bench.norms                          # 5 variants x 3 seeds, 8 epochs each, on the CPU (~15 minutes)
    python -m bench.norms --epochs 16 --seeds 0,1,2,3,4

Data: the demo's synthetic clips (data/synthetic, written if missing). Every variant is configs/quickstart.yaml
(tiny3d, 16-frame clips at 32x32) with data.batch_size: 2 and train.chunk_train_size: 8 (each BatchNorm forward
sees 2 clips x 8 frames), trained from train.seed = each seed:

    batch                 BatchNorm, statistics of each micro-batch chunk (the default)
    batch + precise BN    the same, statistics recomputed over train.precise_bn_batches batches before validation
    group                 GroupNorm (model.norm: group), from scratch
    batch, fine-tuned     BatchNorm, from the checkpoint below (the fair baseline of the next row)
    frozen, fine-tuned    model.norm: frozen from that checkpoint: its statistics kept, scale and shift trained

The checkpoint: the demo's own training at batch 16 (configs/quickstart.yaml, seed 0), with --pretrain-epochs
epochs (fewer than the demo's 16, so it leaves something to learn). Each run is train.py in a fresh process.
Printed per variant: the last epoch's validation clip accuracy over the seeds (mean, min and max), the training
throughput (clips/s from metrics.csv, and its ratio to batch: the step-time cost) and the seconds per epoch with
validation (where precise BN's pass is counted).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile

from datasets.synthetic import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL_BATCH = ["data.batch_size=2", "train.chunk_train_size=8", "train.chunk_train_overlap=0"]


def variants(checkpoint: str, precise_batches: int) -> dict[str, list[str]]:
    return {
        "batch": ["model.norm=batch"],
        "batch + precise BN": ["model.norm=batch", f"train.precise_bn_batches={precise_batches}"],
        "group": ["model.norm=group"],
        "batch, fine-tuned": ["model.norm=batch", f"model.pretrained={checkpoint}"],
        "frozen, fine-tuned": ["model.norm=frozen", f"model.pretrained={checkpoint}"],
    }


def train(overrides: list[str], data: str, out: str) -> list[dict]:
    """train.py with the quickstart preset and ``overrides``; the rows of its metrics.csv."""
    command = [
        sys.executable,
        "train.py",
        "--config",
        CONFIG,
        "--set",
        f"data.data_dir={data}",
        "--set",
        f"trainer.output_dir={out}",
    ] + [item for o in overrides for item in ("--set", o)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "quickstart", "latest", "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def summary(rows: list[dict]) -> dict:
    elapsed = [float(r["elapsed_s"]) for r in rows]
    return {
        "acc": float(rows[-1]["val_clip_acc"]),
        "clips_s": sum(float(r["train_clips_per_s"]) for r in rows) / len(rows),
        "epoch_s": (elapsed[-1] - elapsed[0]) / max(len(rows) - 1, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(ROOT, "data", "synthetic"), help="the demo's data")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--pretrain-epochs", type=int, default=4, help="epochs of the batch-16 checkpoint")
    parser.add_argument("--seeds", default="0,1,2", help="train.seed values, comma-separated")
    parser.add_argument("--precise-batches", type=int, default=32, help="train.precise_bn_batches of that row")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.data, "train.jsonl")):
        generate(args.data)
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as work:
        rows = train([f"train.max_epochs={args.pretrain_epochs}"], args.data, os.path.join(work, "pretrain"))
        checkpoint = os.path.join(work, "pretrain", "quickstart", "latest", "checkpoints", "last.pt")
        print(
            f"normalization at batch 2, training chunks of 8 frames (tiny3d, demo data, {args.epochs} epochs, seeds "
            f"{seeds}, CPU with {os.cpu_count()} CPUs); the batch-16 checkpoint ({args.pretrain_epochs} epochs): "
            f"validation accuracy {float(rows[-1]['val_clip_acc']):.3f}"
        )
        print(
            f"{'variant':20s} {'val acc mean':>12s} {'min':>6s} {'max':>6s} {'clips/s':>8s} {'vs batch':>8s} "
            f"{'s/epoch':>8s}"
        )
        baseline = None
        for name, overrides in variants(checkpoint, args.precise_batches).items():
            runs = [
                summary(
                    train(
                        SMALL_BATCH + overrides + [f"train.max_epochs={args.epochs}", f"train.seed={seed}"],
                        args.data,
                        os.path.join(work, f"{name}-{seed}".replace(" ", "_")),
                    )
                )
                for seed in seeds
            ]
            accuracy = [r["acc"] for r in runs]
            clips_s = sum(r["clips_s"] for r in runs) / len(runs)
            baseline = baseline or clips_s
            print(
                f"{name:20s} {sum(accuracy) / len(accuracy):12.3f} {min(accuracy):6.3f} {max(accuracy):6.3f} "
                f"{clips_s:8.1f} {clips_s / baseline:7.2f}x {sum(r['epoch_s'] for r in runs) / len(runs):8.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
