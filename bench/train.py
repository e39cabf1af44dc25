"""Training benchmark: throughput and peak memory for fp32 vs mixed precision, with and without recomputed blocks.

    python -m bench.train                     # CPU: configs/quickstart.yaml; CUDA: configs/rtx5080.yaml
    python -m bench.train --config configs/cpu.yaml --steps 20

Each variant trains the same steps on the synthetic data (generated into data/synthetic if missing) in a fresh
process, --repeat times (the fastest run is kept). Printed: clips/s, the data-loading share of the step time
(is the model starved?), and the peak memory (CUDA: allocated device memory; CPU: host RSS of the main process,
sampled), each also as a ratio to fp32 without recomputed blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.worker import parse_or_measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(args) -> dict:
    import torch

    import train
    from config import load_config
    from core import memory_monitor
    from core.logs import setup_logging
    from core.runtime import setup_runtime
    from engine.training import build

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            args.config,
            [
                f"trainer.precision={args.precision}",
                f"model.recompute_blocks={args.recompute_blocks}",
                f"trainer.output_dir={out}",
                "trainer.log_every=1000000",
                *args.set,
            ],
        )
        runtime = setup_runtime(cfg.trainer)
        setup_logging(is_main=False)  # errors only: the table is the output
        run, loader, _ = build.build_run(cfg, runtime, stop_after_steps=args.steps)
        if runtime.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with memory_monitor.PeakRssSampler() as sampler:
            metrics = train.train_one_epoch(run, loader)
        result = {
            "clips_per_s": metrics["train_clips_per_s"],
            "data_share": metrics["data_time_share"],
            "steps": run.state.global_step,
            "precision": runtime.precision,
            "peak_mb": sampler.peak_mb,
            "memory": "host RSS",
        }
        if runtime.device.type == "cuda":
            result.update(peak_mb=torch.cuda.max_memory_allocated() / 2**20, memory="device allocated")
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="preset (default: rtx5080 on CUDA, quickstart on the CPU)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per variant")
    parser.add_argument("--repeat", type=int, default=2, help="runs per variant; the fastest is kept")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    args = parse_or_measure(parser, measure, precision=str, recompute_blocks=str)
    if args is None:
        return
    import torch

    cuda = torch.cuda.is_available()
    args.config = args.config or os.path.join(ROOT, "configs", "rtx5080.yaml" if cuda else "quickstart.yaml")
    from config import load_config
    from datasets.synthetic import generate

    data_dir = load_config(args.config, args.set).data.data_dir
    if not os.path.isabs(data_dir):
        data_dir = os.path.join(ROOT, data_dir)
    if data_dir.endswith(os.path.join("data", "synthetic")) and not os.path.exists(data_dir):
        generate(data_dir)
    mixed = "16" if cuda else "bf16"
    print(
        f"{os.path.relpath(args.config, ROOT)}, {args.steps} steps per variant on {'cuda' if cuda else 'cpu'}, "
        f"{os.cpu_count()} CPUs"
    )
    rows = []
    for precision in ("32", mixed):
        for recompute in ("false", "true"):
            command = [
                sys.executable,
                "-m",
                "bench.train",
                "--worker",
                "--config",
                args.config,
                "--steps",
                str(args.steps),
                "--precision",
                precision,
                "--recompute_blocks",
                recompute,
            ]
            for item in args.set:
                command += ["--set", item]
            runs = [
                json.loads(
                    subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
                    .stdout.strip()
                    .splitlines()[-1]
                )
                for _ in range(args.repeat)
            ]
            best = max(runs, key=lambda r: r["clips_per_s"])
            rows.append((precision, recompute, best))
    base = rows[0][2]
    print(
        f"{'precision':>9s} {'recompute_blocks':>16s} {'clips/s':>8s} {'x fp32':>7s} {'data share':>10s} "
        f"{'peak MB (' + base['memory'] + ')':>28s} {'x fp32':>7s}"
    )
    for precision, recompute, r in rows:
        print(
            f"{precision:>9s} {recompute:>16s} {r['clips_per_s']:8.1f} {r['clips_per_s'] / base['clips_per_s']:6.2f}x "
            f"{100 * r['data_share']:9.0f}% {r['peak_mb']:28.0f} {r['peak_mb'] / base['peak_mb']:6.2f}x"
        )


if __name__ == "__main__":
    main()
