"""Memory estimator benchmark: the estimate against a real step's memory on the CPU, and the estimator's speed.

    python -m bench.memory_estimate

(a) For small models on the CPU, one real training step (forward, backward, the real AdamW step in torch's
foreach implementation, which CUDA uses by default; the optimizer state made by a warm-up step first) runs in a fresh process, and the growth of its resident memory during that
step is read from the kernel's high-water mark (reset just before the step through /proc/self/clear_refs;
allocations above 64 KB mapped one by one so resident memory follows the live tensors). Beside it: the
estimator's peak minus what was alive when its step began (parameters, optimizer state, inputs), and the ratio.
The estimator counts tensors in 512-byte blocks; the process also holds what torch allocates outside tensors
(oneDNN's scratch buffers, thread stacks), which the ratio includes.
(b) The estimator's time for train.py --probe-memory's whole grid on configs/rtx5080.yaml (5 x 3 cells, gradient
model.recompute_blocks off and on: 30 estimates), on this machine.
(c) With --part search: the largest-batch search (data.batch_size: auto, --fit-budget, --probe-memory's last line)
on each preset that states a budget: the batch found, the estimates and seconds it took, against bisection's (the
line given no tries) in the same run; the two must find the same batch. A billion-parameter preset's estimates
take minutes each on a CPU: --presets names the ones to run.

    python -m bench.memory_estimate --part search [--presets rtx5080.yaml,gtx1650.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.resident import growth_since, reset_high_water_mark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20

CASES = [  # (name, --set overrides, num_frames, batch)
    ("tiny3d w32 64x64", ["model.width=32", "data.img_size=64"], 32, 4),
    ("tiny3d w32 64x64 ckpt", ["model.width=32", "data.img_size=64", "model.recompute_blocks=true"], 32, 4),
    ("tiny3d w32 64x64 chunks of 8", ["model.width=32", "data.img_size=64", "train.chunk_train_size=8"], 64, 2),
    ("vgg3d w16 64x64", ["model.backbone=vgg3d", "model.width=16", "data.img_size=64"], 16, 4),
    ("r3d_18 64x64", ["model.backbone=r3d_18", "data.img_size=64"], 16, 2),
    ("r3d_18 64x64 ckpt", ["model.backbone=r3d_18", "data.img_size=64", "model.recompute_blocks=true"], 16, 2),
]


def real_step(overrides: list[str], frames: int, batch: int, config: str | None = None, kept: int = 0) -> dict:
    """Resident memory growth of one real training step on the CPU (fp32), of ``config`` (a preset's path) with
    ``overrides``, ``kept`` training chunks not recomputed."""
    import torch

    import train
    from config import load_config
    from core.runtime import Runtime
    from planner.project import ProjectStep

    torch.manual_seed(0)
    cfg = load_config(config, overrides)
    device = torch.device("cpu")
    project = ProjectStep(cfg, train.STEP, kept_chunks=kept, gpu=False)  # the step the estimate runs, real tensors
    classifier = project.classifier().train()
    optimizer = project.optimizer(classifier, foreach=True)  # as on CUDA, where torch picks it
    runtime = Runtime(device, "32")
    scaler = runtime.grad_scaler()
    inputs = project.inputs(frames, batch, device)

    def step():
        project.forward_backward(classifier, inputs, runtime, scaler, 1.0, device)
        project.optimizer_step(classifier, optimizer, scaler)

    step()
    before = reset_high_water_mark()
    step()
    return {"rss_growth": growth_since(before)}


def cpu_step_growth(overrides: list[str], frames: int, batch: int, config: str | None = None, kept: int = 0) -> int:
    """``real_step``'s growth in bytes, measured in a fresh process whose allocations above 64 KB are mapped one by
    one, so resident memory follows the live tensors."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.memory_estimate",
            "--worker",
            json.dumps([overrides, frames, batch, config, kept]),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "the step's process failed")
    return json.loads(done.stdout.strip().splitlines()[-1])["rss_growth"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=("steps", "search"), default="steps", help="steps: (a) and (b); search: (c)")
    parser.add_argument("--presets", help="--part search: these presets (comma-separated file names), not every one")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(real_step(*json.loads(args.worker))))
        return
    import torch

    import train
    from config import load_config
    from planner import memory_table as memory_estimate
    from planner import project

    presets = args.presets.split(",") if args.presets else None
    for name in presets or []:
        if not os.path.isfile(os.path.join(ROOT, "configs", name)):
            parser.error(f"--presets: {name}: no such preset in configs/ (a file name such as rtx5080.yaml)")
    if args.part == "search":
        return search(presets)
    print(
        f"(a) one fp32 training step on the CPU (torch {torch.__version__}, {os.cpu_count()} CPUs): resident "
        f"memory growth of the real step vs the estimate's growth"
    )
    print(f"{'case':30s} {'T':>4s} {'batch':>5s} {'real MiB':>9s} {'estimated MiB':>13s} {'est/real':>8s}")
    for name, overrides, frames, batch in CASES:
        real = cpu_step_growth(overrides, frames, batch)
        estimate = project.config_training_estimate(
            load_config(None, overrides), train.STEP, frames, batch, precision="32"
        )
        growth = estimate.peak - estimate.before_step
        print(
            f"{name:30s} {frames:>4d} {batch:>5d} {real / MiB:>9.1f} {growth / MiB:>13.1f} {growth / real:>7.2f}x",
            flush=True,
        )
    print("(b) train.py --probe-memory's grid on configs/rtx5080.yaml (30 estimates)")
    cfg = load_config(os.path.join(ROOT, "configs", "rtx5080.yaml"))
    start = time.perf_counter()
    memory_estimate.probe(cfg, train.STEP, False, out=lambda line: None, num_views=1, kpt_shape=None, num_classes=10)
    print(f"{time.perf_counter() - start:.1f} s, including the search for the largest batch that fits")


def search(presets: list[str] | None) -> None:
    """(c): each budgeted preset's (or each of ``presets``) largest batch at its num_frames, by the line-guided
    search and by bisection."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # a hub backbone not downloaded before is named, not fetched
    import train
    from bench.gpu import gpu_presets
    from config import load_config
    from models.registry import ModelConfigError
    from planner import project
    from planner.estimate import usable_bytes

    print("(c) the largest batch that fits each preset's budget (CUDA's usable bytes), searched two ways")
    print(f"{'preset':28s} {'batch':>5s} {'estimates':>9s} {'s':>6s} {'bisection':>9s} {'s':>6s} {'time ratio':>10s}")
    for name in presets or gpu_presets():
        cfg = load_config(os.path.join(ROOT, "configs", name))
        usable = usable_bytes(cfg.trainer.memory_budget_gb, cuda=True)
        found = {}
        try:
            # one estimate first, untimed: the first of a process traces and caches what the later ones reuse
            project.config_training_estimate(cfg, train.STEP, project.clip_frames(cfg.data), 1)
            for label, line_tries in (("line", None), ("bisection", 0)):
                start = time.perf_counter()
                frames = project.clip_frames(cfg.data)
                batch, tried = project.largest_batch(cfg, train.STEP, frames, usable, line_tries=line_tries)
                found[label] = (batch, len(tried), time.perf_counter() - start)
        except ModelConfigError as error:  # a pretrained backbone neither cached nor on disk here
            print(f"{name:28s} not measured: {error}", flush=True)
            continue
        (batch, count, seconds), (other, other_count, other_seconds) = found["line"], found["bisection"]
        assert batch == other, (name, found)
        print(
            f"{name:28s} {batch:>5d} {count:>9d} {seconds:>6.1f} {other_count:>9d} {other_seconds:>6.1f} "
            f"{seconds / other_seconds:>9.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
