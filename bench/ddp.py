"""train.ddp_sync on 2 gloo processes: the step time of agreed and during_backward, and the memory each holds beyond one
process, against the planner's estimate.

    python -m bench.ddp                                     # r3d_18 at 64x64, 8 frames, batch 2 a process
    python -m bench.ddp --backbone tiny3d --steps 10

Each mode runs train.py's step (``engine.training.build.wrap_for_training``, ``train.forward_backward``) in its
own ``torchrun --nproc_per_node=2``, SGD, fp32, on the CPU. Time: the median of --steps steps after one warm-up
step (forward, backward, the gradients averaged: DDP's hooks during backward with during_backward, ``agree_and_reduce``'s
averaging after it with agreed; the optimizer step). Memory: rank 0's peak resident memory during the steps above
what it held before the model was wrapped, and its difference to agreed's (DistributedDataParallel's buckets),
beside what the planner adds to one process's estimated peak for 2 processes. A CPU figure: gloo over loopback on 2 cores that also compute, so
the all-reduce during backward has little to hide behind; on GPUs with NCCL the balance differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 2**20


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def worker(args) -> None:
    from functools import partial

    import torch

    import train
    from config import load_config
    from core.runtime import setup_runtime
    from datasets.device_input import DeviceInputs
    from engine.training import build
    from engine.training.chunked_forward import ChunkSpec
    from engine.training.oom import average_gradients
    from engine.training.step import training_losses
    from models import build_model

    cfg = load_config(
        None,
        [
            f"model.backbone={args.backbone}",
            f"train.ddp_sync={args.mode}",
            "trainer.device=cpu",
            f"data.img_size={args.size}",
        ],
    )
    runtime = setup_runtime(cfg.trainer)
    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes=10).train()
    device_inputs = DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std)
    before = _status_bytes("VmRSS")
    wrapped = build.wrap_for_training(model, device_inputs, cfg, runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = runtime.grad_scaler()
    losses = partial(training_losses, train_cfg=cfg.train, criterion=torch.nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(runtime.rank)
    clip = torch.randint(
        0, 255, (args.batch, 3, args.frames, args.size, args.size), dtype=torch.uint8, generator=generator
    )
    piece = {"label": torch.arange(args.batch) % 10}

    def step() -> float:
        start = time.perf_counter()
        inputs = device_inputs.transfer({"video": clip})
        train.forward_backward(wrapped, inputs, piece, ChunkSpec(), losses, runtime, scaler, 1.0)
        if args.mode == "agreed":
            average_gradients([p.grad for p in model.parameters() if p.grad is not None], runtime.world_size)
        train.optimizer_step(model, optimizer, scaler, schedule, None)
        return time.perf_counter() - start

    step()
    times = sorted(step() for _ in range(args.steps))
    if runtime.rank == 0:
        grown = _status_bytes("VmHWM") - before  # the steps' peak resident memory above the unwrapped model's
        print(
            json.dumps(
                {
                    "step_s": times[len(times) // 2],
                    "grown_mb": grown / MB,
                    "gradients_mb": sum(p.numel() * 4 for p in model.parameters()) / MB,
                }
            )
        )
    torch.distributed.destroy_process_group()


def estimate_added_mb(args, mode: str) -> float:
    import train
    from config import load_config
    from planner.project import config_training_estimate

    cfg = load_config(
        None,
        [
            f"model.backbone={args.backbone}",
            f"train.ddp_sync={mode}",
            "train.optimizer=sgd",
            f"data.img_size={args.size}",
        ],
    )
    alone = config_training_estimate(cfg, train.STEP, args.frames, args.batch)
    several = config_training_estimate(cfg, train.STEP, args.frames, args.batch, world_size=2)
    return (several.peak - alone.peak) / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="r3d_18")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="clips per process")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="agreed", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(
        f"{args.backbone} at {args.size}x{args.size}, {args.frames} frames, batch {args.batch} a process, 2 gloo "
        f"processes on {os.cpu_count()} CPUs, SGD, fp32; median of {args.steps} steps"
    )
    rows = {}
    for mode in ("agreed", "during_backward"):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "bench.ddp",
            "--worker",
            "--mode",
            mode,
            "--backbone",
            args.backbone,
            "--size",
            str(args.size),
            "--frames",
            str(args.frames),
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
        ]
        result = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}
        )
        if result.returncode != 0:
            print(f"{mode}: failed: {result.stderr.strip().splitlines()[-1]}")
            return
        rows[mode] = json.loads(result.stdout.strip().splitlines()[-1])
    print(
        f"{'train.ddp_sync':<15s} {'s/step':>7s} {'x agreed':>8s} {'peak growth MB':>14s} {'x agreed':>8s} "
        f"{'estimate: added to one process MB':>33s}"
    )
    for mode, row in rows.items():
        print(
            f"{mode:<15s} {row['step_s']:>7.3f} {row['step_s'] / rows['agreed']['step_s']:>7.2f}x "
            f"{row['grown_mb']:>14.1f} {row['grown_mb'] - rows['agreed']['grown_mb']:>+7.1f}M "
            f"{estimate_added_mb(args, mode):>33.1f}"
        )
    print(f"(gradients: {rows['agreed']['gradients_mb']:.1f} MB)")


if __name__ == "__main__":
    main()
