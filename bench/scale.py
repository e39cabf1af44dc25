"""An hour of video against a minute: the peak resident memory of every stage of the two-stage timeline path
(docs/timelines.md), each in a fresh process, on one video of ``--frames`` frames against the same stages on a
600-frame video, in the same run.

    python -m bench.scale                    # 90,000 frames: an hour at 25 fps (about 25 minutes on 2 cores)
    python -m bench.scale --frames 6000      # a quick look (about 3 minutes)

The videos have the timeline task's looks (datasets/segmentation_task.py: 32x32, segments of 40-120 frames, about
1,100 in an hour), written as they are made. A backbone (configs/timelines.yaml, tiny3d) trains one epoch on the
short video; then, for each length: its features (``infer_chunked.py --features``), a tcn and a transformer head
trained one epoch on them (configs/timelines-head.yaml, the video as its own validation), each head's timeline
(``infer_chunked.py --timeline``) and ``eval.py`` of each head. Printed: each stage's peak RSS (the process's
ru_maxrss) at both lengths and their ratio, and the planner's estimate of a head's training step over the long
video's chunks against the measured growth of that stage's peak from the short video.

A process's peak includes its start-up and validation; the planner states one training step. So each head's step
is also measured alone: a fresh process per head and length (the short video's chunks, the long video's, 11,250:
an hour at stride 1 in chunks of 8), one warm-up step, then the resident memory's high-water mark over one
training step (forward, dense loss, backward, AdamW) against its level before, every allocation over 64 KB its own
mapping so resident memory follows the live tensors (as ``bench.train_chunked`` measures); against the planner's
estimate of the same step (its peak over what was alive as it began).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from bench.resident import growth_since, reset_high_water_mark
from config import load_config
from datasets.long_range_tasks import EVENT_COLOURS
from datasets.segmentation_task import LOOKS, SEGMENT_CLASSES
from datasets.video_files import write_video
from engine.inference.features import read_header
from planner.features import feature_training_estimate
from train import STEP

STEP_CHUNKS = 11_250  # an hour at 25 fps in chunks of 8 frames at stride 1

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = 600
SIZE, FPS = 32, 25.0


def write_segmented_video(path: str, frames: int, seed: int) -> list[dict]:
    """The timeline task's looks over ``frames`` frames, written frame by frame (an hour is never in memory);
    its segments [{"start", "end", "label"}]."""
    rng = np.random.default_rng(seed)
    segments, start, previous = [], 0, None
    while start < frames:
        length = int(rng.integers(40, 121))
        end = frames if frames - (start + length) < 40 else start + length
        look = str(rng.choice([look for look in LOOKS if look != previous]))
        segments.append(
            {
                "start": start,
                "end": end,
                "label": look if previous is None else f"{look}_after_{previous}",
                "look": look,
            }
        )
        start, previous = end, look

    def made():
        for segment in segments:
            tint = np.array(EVENT_COLOURS[LOOKS[segment["look"]]])
            for _ in range(segment["end"] - segment["start"]):
                noise = rng.integers(90, 166, size=(SIZE, SIZE, 3), dtype=np.uint8)
                yield (0.6 * noise + 0.4 * tint).astype(np.uint8)

    write_video(path, made(), SIZE, FPS)
    return [{k: s[k] for k in ("start", "end", "label")} for s in segments]


def peak_rss_mib(args: list[str], log: str) -> float:
    """Run ``python ARGS`` in the repository; its peak resident memory in MiB (exits with its output if it fails)."""
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        with open(log) as f:
            raise SystemExit(f"python {' '.join(args)} failed:\n{f.read()[-3000:]}")
    return usage.ru_maxrss / 1024


def sets(*items: str) -> list[str]:
    return [word for item in items for word in ("--set", item)]


def measure(work: str, frames: int) -> dict:
    videos = {SHORT: None, frames: None}
    for length in videos:
        path = os.path.join(work, f"video_{length}.mp4")
        segments = write_segmented_video(path, length, seed=length)
        manifest = os.path.join(work, f"video_{length}.jsonl")
        with open(manifest, "w") as f:
            f.write(json.dumps({"video": path, "segments": segments}) + "\n")
        videos[length] = manifest
        print(f"video of {length} frames: {len(segments)} segments", flush=True)
    data = sets(
        f"data.data_dir={work}",
        f"data.train_manifest={videos[SHORT]}",
        f"data.val_manifest={videos[SHORT]}",
        "data.num_workers=0",
        "data.sample_timeout_s=null",
        "train.max_epochs=1",
        f"trainer.output_dir={work}/runs",
    )
    peak_rss_mib(
        ["train.py", "--config", "configs/timelines.yaml", *data, "--set", "experiment=backbone"],
        os.path.join(work, "backbone.log"),
    )
    backbone = os.path.join(work, "runs", "backbone", "latest", "checkpoints", "last.pt")
    rows: dict[str, dict] = {}
    estimates = {}
    for length, manifest in videos.items():
        features = os.path.join(work, f"features_{length}")

        def stage(name: str, args: list[str], length: int = length) -> None:
            rows.setdefault(name, {})[length] = peak_rss_mib(args, os.path.join(work, f"{name}_{length}.log"))
            print(f"{name:<44s} {length:>7d} frames: {rows[name][length]:8.0f} MiB", flush=True)

        stage(
            "infer_chunked.py --features",
            ["infer_chunked.py", "--checkpoint", backbone, "--input", manifest, "--features", features],
        )
        header = read_header(os.path.join(features, f"video_{length}.npz"))
        for head in ("tcn", "transformer"):
            run = f"head_{head}_{length}"
            stage(
                f"train the {head} head on features",
                [
                    "train.py",
                    "--config",
                    "configs/timelines-head.yaml",
                    *sets(
                        f"data.features_dir={features}",
                        f"data.train_manifest={manifest}",
                        f"data.val_manifest={manifest}",
                        f"model.temporal_head={head}",
                        f"experiment={run}",
                        f"trainer.output_dir={work}/runs",
                        "train.max_epochs=1",
                    ),
                ],
            )
            checkpoint = os.path.join(work, "runs", run, "latest", "checkpoints", "last.pt")
            stage(
                f"infer_chunked.py --timeline, {head} head",
                ["infer_chunked.py", "--checkpoint", checkpoint, "--input", manifest, "--timeline"],
            )
            stage(f"eval.py, {head} head", ["eval.py", "--checkpoint", checkpoint, "--data", manifest])
            cfg = load_config(
                os.path.join(ROOT, "configs", "timelines-head.yaml"),
                [f"model.temporal_head={head}", f"data.features_dir={features}"],
            )
            estimates[(head, length)] = (
                feature_training_estimate(
                    cfg, STEP, int(header["feature_dim"]), int(header["chunks"]), 1, len(SEGMENT_CLASSES)
                ).peak
                / 2**20
            )
        rows.setdefault("(chunks a video)", {})[length] = int(header["chunks"])
    chunks = rows["(chunks a video)"]
    steps = {
        (head, n): measure_step(head, n, int(header["feature_dim"]))
        for head in ("tcn", "transformer")
        for n in sorted({chunks[SHORT], chunks[frames], STEP_CHUNKS})
    }
    return {"rows": rows, "estimates": estimates, "steps": steps}


def head_step_parts(head: str, chunks: int, feature_dim: int, device="cpu"):
    """(config, head, optimizer, batch, one training step) of ``head`` (configs/timelines-head.yaml) over one video
    of ``chunks`` chunks on ``device`` (the CPU by default)."""
    from functools import partial

    import torch

    import train
    from core.runtime import Runtime
    from engine.training.chunked_forward import ChunkSpec, FeatureHeadForward
    from engine.training.optim import build_optimizer
    from engine.training.step import training_losses
    from models import build_feature_head

    torch.manual_seed(0)
    cfg = load_config(
        os.path.join(ROOT, "configs", "timelines-head.yaml"),
        [f"model.temporal_head={head}", "data.features_dir=unused"],
    )
    classes = len(SEGMENT_CLASSES)
    model = build_feature_head(cfg.model, feature_dim, classes).to(device).train()
    optimizer = build_optimizer(model, cfg.train)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    runtime = Runtime(torch.device(device), "32")
    scaler = runtime.grad_scaler()
    losses = partial(training_losses, train_cfg=cfg.train, criterion=torch.nn.CrossEntropyLoss())
    starts = torch.arange(chunks, dtype=torch.float32) * 16
    batch = {
        "features": torch.randn(1, chunks, feature_dim),
        "windows": torch.stack([starts, starts + 16], -1)[None],
        "mask": torch.ones(1, chunks, dtype=torch.bool),
        "chunk_labels": torch.randint(0, classes, (1, chunks)),
        "label": torch.zeros(1, dtype=torch.long),
    }
    batch = {key: value.to(device) for key, value in batch.items()}

    def step() -> None:  # train.py's step, over the features of whole videos
        train.forward_backward(FeatureHeadForward(model), batch, batch, ChunkSpec(), losses, runtime, scaler, 1.0)
        train.optimizer_step(model, optimizer, scaler, schedule, None)

    return cfg, model, optimizer, batch, step


def step_worker(head: str, chunks: int, feature_dim: int) -> dict:
    """In this (fresh) process: one training step of ``head`` (configs/timelines-head.yaml) over one video of
    ``chunks`` chunks, measured after a warm-up step; and the planner's estimate of it (MiB)."""
    cfg, model, optimizer, batch, step = head_step_parts(head, chunks, feature_dim)
    classes = len(SEGMENT_CLASSES)
    step()  # the optimizer state and the thread pools arrive in the first step
    before = reset_high_water_mark()
    step()
    measured = growth_since(before) / 2**20
    estimate = feature_training_estimate(cfg, STEP, feature_dim, chunks, 1, classes)
    return {"measured": measured, "estimated": (estimate.peak - estimate.before_step) / 2**20}


def measure_step(head: str, chunks: int, feature_dim: int) -> dict:
    command = [sys.executable, "-m", "bench.scale", "--step-worker", head, str(chunks), str(feature_dim)]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(result: dict, frames: int) -> str:
    rows, estimates = result["rows"], result["estimates"]
    lines = [f"| stage | {SHORT:,} frames | {frames:,} frames | x |", "|---|---|---|---|"]
    for name, by_length in rows.items():
        if name.startswith("("):
            lines.append(f"| {name} | {by_length[SHORT]:,} | {by_length[frames]:,} | |")
            continue
        lines.append(
            f"| `{name}` | {by_length[SHORT]:,.0f} MiB | {by_length[frames]:,.0f} MiB | "
            f"{by_length[frames] / by_length[SHORT]:.2f} |"
        )
    lines.append("")
    lines.append("| head: a training step | estimated growth | measured growth of the peak | estimate / measured |")
    lines.append("|---|---|---|---|")
    for head in ("tcn", "transformer"):
        estimated = estimates[(head, frames)] - estimates[(head, SHORT)]
        stage = rows[f"train the {head} head on features"]
        measured = stage[frames] - stage[SHORT]
        lines.append(
            f"| {head} | {estimated:,.1f} MiB | {measured:,.1f} MiB | "
            f"{estimated / measured if measured > 0 else float('nan'):.2f} |"
        )
    lines.append("")
    lines.append("| head: one training step alone | chunks | measured | estimated | estimate / measured |")
    lines.append("|---|---|---|---|---|")
    for (head, chunks), step in result["steps"].items():
        lines.append(
            f"| {head} | {chunks:,} | {step['measured']:,.1f} MiB | {step['estimated']:,.1f} MiB | "
            f"{step['estimated'] / step['measured']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=90_000, help="the long video's frames (default: an hour)")
    parser.add_argument("--work", help="where the videos, features and runs go (default: a temporary folder)")
    parser.add_argument("--step-worker", nargs=3, metavar=("HEAD", "CHUNKS", "FEATURE_DIM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step_worker:
        head, chunks, feature_dim = args.step_worker
        print(json.dumps(step_worker(head, int(chunks), int(feature_dim))))
        return 0
    if args.frames <= SHORT:
        parser.error(f"--frames must be more than the short video's {SHORT}")
    if args.work:
        os.makedirs(args.work, exist_ok=True)
        result = measure(os.path.abspath(args.work), args.frames)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as work:
            result = measure(work, args.frames)
    print(report(result, args.frames))
    return 0


if __name__ == "__main__":
    sys.exit(main())
