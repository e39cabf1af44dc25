"""Length consistency: a model trained on videos (or sample windows) of one length, evaluated on videos 4x and 16x
as long, each whole in one stream (eval.py --num-frames -1), as infer_chunked.py runs them.

    python -m bench.length                           # both parts (about 40 minutes on 2 cores)
    python -m bench.length --part timelines          # the timeline task only (about 15 minutes)
    python -m bench.length --part families --families order,distractors

--part timelines: the timeline task (datasets/segmentation_task.py, 32x32): a backbone trained per chunk
(configs/timelines.yaml, its heads off), its features, and two heads trained on the features of 600-frame videos
(configs/timelines-head.yaml: the tcn and the transformer with its contrast); each evaluated on validation videos
of 600, 2,400 and 9,600 frames (38, 150 and 600 chunks). The backbone alone (each chunk classified, no context)
is the baseline no length can move. Printed: frame accuracy and F1@50 at each length.

--part families: the long-range families (datasets/long_range_tasks.py) at their bench.long_range shape,
trained end to end on their videos (configs/long-range.yaml: the transformer with its contrast, the tcn, the chunk
logits averaged), then evaluated on validation videos whose length and event gaps are 4x and 16x the training
ones (events as long as in training; the same labels). Mean pooling is at chance at every length by the tasks'
construction: the reference. Printed: video accuracy at each length (the clip logits come from one pass over every
chunk, so infer.head_chunks does not change them).

Each run is a fresh process (train.py, infer_chunked.py, eval.py) on data written under --work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.long_range import FAMILY_SHAPES, family_data
from bench.scale import sets
from datasets.long_range_tasks import TASKS, generate_long_range, generate_task
from datasets.segmentation_task import generate_segmentation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALES = (1, 4, 16)
ORDER_SHAPE = {"frames": 1024, "event_frames": 12, "min_gap": 320}  # generate_long_range's defaults


def python(args: list[str], log: str) -> None:
    """``python ARGS`` in the repository, its output to ``log``; exits with its tail if it fails."""
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        with open(log) as f:
            raise SystemExit(f"python {' '.join(args)} failed:\n{f.read()[-3000:]}")


def evaluate(work: str, checkpoint: str, manifest: str, name: str, extra: list[str] = ()) -> dict:
    """eval.py's metrics of ``checkpoint`` on ``manifest``, every video whole in one stream."""
    prefix = os.path.join(work, "eval", name)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    python(
        ["eval.py", "--checkpoint", checkpoint, "--data", manifest, "--num-frames", "-1", "--output", prefix, *extra],
        prefix + ".log",
    )
    with open(prefix + ".json") as f:
        return json.load(f)["metrics"]


def train(work: str, experiment: str, config: str, overrides: list[str]) -> str:
    """Train ``config`` with ``overrides``; its best checkpoint (one already under --work is kept: a run goes on
    where an interrupted one stopped)."""
    best = os.path.join(work, "runs", experiment, "latest", "checkpoints", "best.pt")
    if os.path.exists(best):
        return best
    python(
        [
            "train.py",
            "--config",
            config,
            *sets(f"trainer.output_dir={work}/runs", f"experiment={experiment}", *overrides),
        ],
        os.path.join(work, f"{experiment}.log"),
    )
    return best


def scored(work: str, name: str, checkpoint: str, validation: dict, head: bool) -> list[tuple[str, dict]]:
    """(row name, {scale: eval.py's metrics}) of ``checkpoint`` on each scale's ``validation`` manifest: with a
    temporal head, in windows of its training length (infer.head_chunks: auto) and whole (-1)."""
    ways = (
        {"": []}
        if not head
        else {", windows (auto)": ["--head-chunks", "auto"], ", whole video": ["--head-chunks", "-1"]}
    )
    rows = []
    for way, flags in ways.items():
        tag = name.replace(" ", "_").replace(":", "") + ("_whole" if "whole" in way else "")
        rows.append(
            (
                name + way,
                {scale: evaluate(work, checkpoint, validation[scale], f"{tag}_{scale}x", flags) for scale in SCALES},
            )
        )
    return rows


def timelines(work: str, args) -> list[tuple[str, dict]]:
    data = {
        scale: generate_segmentation(
            os.path.join(work, f"seg_{scale}x"),
            size=32,
            frames=600 * scale,
            num_train=48 if scale == 1 else 0,
            num_val=args.timeline_videos,
            quiet=True,
        )
        for scale in SCALES
    }
    val = {scale: os.path.join(data[scale], "seg_val.jsonl") for scale in SCALES}
    base = [f"data.data_dir={data[1]}", "data.num_workers=0"]
    backbone = train(work, "backbone", "configs/timelines.yaml", base + [f"train.max_epochs={args.backbone_epochs}"])
    features = os.path.join(work, "features")
    for manifest in (os.path.join(data[1], "seg_train.jsonl"), val[1]):  # eval.py streams the longer videos
        python(
            ["infer_chunked.py", "--checkpoint", backbone, "--input", manifest, "--features", features],
            os.path.join(work, "features.log"),
        )
    models = {"backbone alone (each chunk)": backbone}
    for head in ("tcn", "transformer"):
        models[f"features + {head}"] = train(
            work,
            f"head_{head}",
            "configs/timelines-head.yaml",
            base
            + [
                f"data.features_dir={features}",
                f"model.temporal_head={head}",
                f"train.max_epochs={args.head_epochs}",
            ],
        )
    rows = []
    for name, checkpoint in models.items():
        for row, scores in scored(work, name, checkpoint, val, head=name.startswith("features")):
            rows.append((row, scores))
            print(
                f"timelines  {row:46s} "
                + "  ".join(
                    f"{scale:2d}x: acc {s['seg_frame_acc']:.3f} F1@50 {s['seg_f1@50']:5.1f}"
                    for scale, s in scores.items()
                ),
                flush=True,
            )
    return rows


def long_validation(work: str, family: str, scale: int, videos: int) -> str:
    """The family's validation videos at ``scale`` times its length and gaps; their manifest."""
    if family == "order":
        shape = {**ORDER_SHAPE, "frames": ORDER_SHAPE["frames"] * scale, "min_gap": ORDER_SHAPE["min_gap"] * scale}
        root = generate_long_range(
            os.path.join(work, f"order_{scale}x"), num_train=0, num_val=videos, quiet=True, **shape
        )
        return os.path.join(root, "order_val.jsonl")
    spec = TASKS[family]
    root = generate_task(
        os.path.join(work, f"{family}_{scale}x"),
        family,
        num_train=0,
        num_val=videos,
        quiet=True,
        frames=spec["frames"] * scale,
        min_gap=spec["min_gap"] * scale,
    )
    return os.path.join(root, f"{family}_val.jsonl")


def families(work: str, args) -> list[tuple[str, dict]]:
    rows = []
    for family in args.families.split(","):
        data, shape = family_data(family, os.path.join(ROOT, "data"))
        name = "order_val.jsonl" if family == "order" else f"{family}_val.jsonl"
        val = {1: os.path.join(data, name)}
        val.update({scale: long_validation(work, family, scale, args.family_videos) for scale in SCALES[1:]})
        for head, label in (("transformer", "transformer"), ("tcn", "tcn"), ("none", "mean of chunk logits")):
            checkpoint = train(
                work,
                f"{family}_{head}",
                "configs/long-range.yaml",
                [
                    f"data.data_dir={data}",
                    *shape,
                    f"model.temporal_head={head}",
                    f"train.max_epochs={args.family_epochs}",
                ],
            )
            # one evaluation: the video's label comes from one pass over every chunk, windows or not
            for row, scores in scored(work, f"{family}: {label}", checkpoint, val, head=False):
                rows.append((row, scores))
                print(
                    f"families   {row:46s} "
                    + "  ".join(f"{scale:2d}x: acc {s['video_acc']:.3f}" for scale, s in scores.items()),
                    flush=True,
                )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.length", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=("timelines", "families", "both"), default="both")
    parser.add_argument(
        "--families",
        default="order,distractors",
        help=f"--part families: which, comma-separated, of {', '.join(FAMILY_SHAPES)}",
    )
    parser.add_argument("--work", help="where data, runs and evaluations go (default: a temporary folder)")
    parser.add_argument("--backbone-epochs", type=int, default=3)
    parser.add_argument("--head-epochs", type=int, default=40)
    parser.add_argument("--family-epochs", type=int, default=12)
    parser.add_argument("--timeline-videos", type=int, default=16, help="validation videos at each length")
    parser.add_argument("--family-videos", type=int, default=48, help="validation videos at 4x and 16x")
    args = parser.parse_args(argv)
    unknown = [name for name in args.families.split(",") if name not in FAMILY_SHAPES]
    if unknown:
        parser.error(f"--families: unknown {', '.join(unknown)}; choose from {', '.join(FAMILY_SHAPES)}")
    with tempfile.TemporaryDirectory(prefix="bench-length-") as temporary:
        work = os.path.abspath(args.work) if args.work else temporary
        os.makedirs(work, exist_ok=True)
        if args.part in ("timelines", "both"):
            timelines(work, args)
        if args.part in ("families", "both"):
            families(work, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
