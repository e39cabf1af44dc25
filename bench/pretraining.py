"""Pretraining without labels (train.objective: motion) against a backbone from scratch, on the long-range task
families.

    python -m bench.pretraining --families match --modalities motion                 # one case, seed 0
    python -m bench.pretraining --families match,twice --modalities motion,texture --seeds 0,1,2
    python -m bench.pretraining --families match --modalities motion --pretrain-videos 480   # 5x unlabelled videos
    python -m bench.pretraining --part step                                          # time and memory of a step

--part families (the default): for each --families x --modalities case and seed, the backbone is pretrained with
configs/long-range.yaml and --set train.objective=motion on the case's training videos (their labels unused; with
--pretrain-videos N, on N videos of the family, as many more unlabelled ones), then each --presets variant of
``python -m bench.long_range --part families`` fine-tunes it (model.pretrained) beside the same variant from
scratch. Printed: the pretraining's best validation direction accuracy (chance 0.125); how far the backbone's chunk
features keep the event's two kinds apart (``bench.long_range --part separability``'s nearest-centroid and linear
probe accuracy) at random initialization and after pretraining, on the clips as the fine-tuning reads them (--set's
changes to data.num_frames, data.frame_stride or train.chunk_train_size included); then the families' lines, from
scratch and pretrained.

--part probe: the pretraining and the probes alone, no fine-tuning; --pretrain-set KEY=VALUE changes the
pretraining's config (its checkpoints kept apart by the changes).

--part demo: configs/quickstart.yaml on the demo's data (made by other code than the families': a shape moving up,
down, left or right, growing or shrinking), from scratch and from configs/pretrain.yaml's backbone pretrained on
the same training videos without labels, at each of --seeds: best validation accuracies.

--part step: one training step of the long-range preset's shape (a 160-frame clip in chunks of 16, batch 1, fp32)
with the motion objective against the label's, each measured as ``python -m bench.train_chunked`` measures a step
(time, and host RSS growth during the step), in a fresh process each.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from bench.long_range import (
    FAMILY_SHAPES,
    FAMILY_VIDEOS,
    LONG_RANGE_PRESET,
    PRESETS,
    ROOT,
    families,
    family_data,
    train_variant,
)
from datasets.long_range_tasks import MODALITIES
from engine.training.chunked_forward import seed_of
from tests.long_range_probes import event_chunks, kinds_apart

MOTION = ["train.objective=motion"]


def pretrained(args, family: str, modality: str):
    """``weights(seed)``: the checkpoint of the motion objective's run on the case's videos at that seed (kept in
    data/long_range_pretrained, trained there first if missing)."""
    data, shape = family_data(family, os.path.join(ROOT, "data"), modality, args.pretrain_videos)
    videos = "" if args.pretrain_videos == FAMILY_VIDEOS else f"_{args.pretrain_videos}videos"
    changes = f"_{seed_of(*map(ord, ' '.join(args.pretrain_set))) % 10**8:08d}" if args.pretrain_set else ""

    def weights(seed: int) -> str:
        name = f"{family}_{modality}{videos}_motion{changes}_seed{seed}_{args.pretrain_epochs}epochs.pt"
        path = os.path.join(ROOT, "data", "long_range_pretrained", name)
        if not os.path.exists(path):
            start = time.perf_counter()
            run = train_variant(
                shape + MOTION + args.pretrain_set,
                data,
                args.pretrain_epochs,
                seed,
                LONG_RANGE_PRESET,
                keep=path,
                metric="val_direction_acc",
            )
            print(
                f"  pretrained on {family}/{modality}{videos} without labels, seed {seed}: best direction accuracy "
                f"{run['best']:.3f} (by epoch {' '.join(f'{a:.3f}' for a in run['by_epoch'])}), "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
        return path

    return weights


def probe_clips(args, family: str, modality: str) -> tuple[torch.Tensor, list[str], int]:
    """The family's probe clips as its fine-tuning sees them (the shape, with --set's changes to it): (uint8 clips,
    the event kind of each chunk, the chunk's frames)."""
    from config import load_config

    data, shape = family_data(family, os.path.join(ROOT, "data"), modality)
    cfg = load_config(LONG_RANGE_PRESET, shape + args.set)
    chunk = cfg.train.chunk_train_size
    clips, kinds = event_chunks(family, data, cfg.data.num_frames, chunk, cfg.data.frame_stride)
    return clips, kinds, chunk


def probe(clips: torch.Tensor, kinds: list[str], chunk: int, seed: int, weights: str | None, preset) -> dict:
    """``kinds_apart`` of the backbone of ``preset`` (the long-range preset's config) initialized at ``seed``, with
    ``weights`` loaded, on ``probe_clips``'s clips."""
    from models import build_model

    torch.manual_seed(seed)
    model = build_model(dataclasses.replace(preset.model, pretrained=weights), num_classes=2)
    return kinds_apart(model, clips, kinds, chunk, preset.data.mean, preset.data.std)


def cases(args) -> None:
    from config import load_config

    seeds = [int(s) for s in args.seeds.split(",")]
    preset = load_config(LONG_RANGE_PRESET, [])
    for modality in args.modalities.split(","):
        for family in args.families.split(","):
            weights = pretrained(args, family, modality)
            clips, kinds, chunk = probe_clips(args, family, modality)  # decoded once for every seed's two probes
            for seed in seeds:  # every family has events of kinds A and B
                before = probe(clips, kinds, chunk, seed, None, preset)
                after = probe(clips, kinds, chunk, seed, weights(seed), preset)
                print(
                    f"  {family}/{modality} seed {seed}: A/B apart, nearest centroid {before['accuracy']:.3f} -> "
                    f"{after['accuracy']:.3f}, linear probe {before['linear']:.3f} -> {after['linear']:.3f}",
                    flush=True,
                )
            if args.part == "probe":
                for seed in seeds:  # the pretraining's line, where it ran
                    weights(seed)
                continue
            case = dataclasses.replace(args, families=family, modalities=modality)
            families(case)
            families(case, weights, source=f"pretrained without labels on {args.pretrain_videos} videos")


def demo(args) -> None:
    """--part demo: configs/quickstart.yaml on the demo's data (datasets/synthetic.py: a shape moving up, down, left
    or right, growing or shrinking), from scratch and from configs/pretrain.yaml's backbone pretrained on the same
    training videos without their labels, at each seed."""
    import csv
    import subprocess
    import sys
    import tempfile

    from datasets.synthetic import generate

    data = os.path.join(ROOT, "data", "synthetic")
    if not os.path.exists(os.path.join(data, "train.jsonl")):
        generate(data, quiet=True)

    def run(config: str, out: str, seed: int, *changes: str) -> list[dict]:
        sets = [f"data.data_dir={data}", f"trainer.output_dir={out}", f"train.seed={seed}", "trainer.plots=false"]
        command = [sys.executable, "train.py", "--config", os.path.join(ROOT, "configs", config)]
        for item in sets + list(changes):
            command += ["--set", item]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        experiment = "pretrain" if config == "pretrain.yaml" else "quickstart"
        with open(os.path.join(out, experiment, "latest", "metrics.csv"), newline="") as f:
            return list(csv.DictReader(f))

    print(
        f"{'seed':>4s} {'pretraining: direction acc':>26s} {'from scratch: clip acc':>22s} {'pretrained: clip acc':>20s}"
    )
    for seed in [int(s) for s in args.seeds.split(",")]:
        with tempfile.TemporaryDirectory() as out:
            pretraining = run("pretrain.yaml", out, seed, *args.pretrain_set)
            best = os.path.join(out, "pretrain", "latest", "checkpoints", "best.pt")
            scratch = run("quickstart.yaml", out, seed, *args.set)
            tuned = run("quickstart.yaml", out, seed, f"model.pretrained={best}", *args.set)
        top = {
            name: max(float(r[metric]) for r in rows)
            for name, rows, metric in (
                ("pretraining", pretraining, "val_direction_acc"),
                ("scratch", scratch, "val_clip_acc"),
                ("tuned", tuned, "val_clip_acc"),
            )
        }
        print(f"{seed:4d} {top['pretraining']:26.3f} {top['scratch']:22.3f} {top['tuned']:20.3f}", flush=True)


def step(args) -> None:
    """--part step: the motion objective's training step against the label's, at the long-range preset's shape."""
    from bench.train_chunked import step_cell

    frames, chunk = 160, 16
    cells = {
        objective: step_cell(
            "tiny3d", 16, 32, frames, chunk, repeat=3, temporal_head=head, reconstruction=0.0, objective=objective
        )
        for objective, head in (("labels", "transformer"), ("motion", "none"))
    }
    print(f"one training step: tiny3d width 16, a {frames}-frame clip of 32x32 in chunks of {chunk}, batch 1, fp32")
    print(f"{'objective':10s} {'s/step':>8s} {'step MB':>8s}")
    for objective, cell in cells.items():
        if not isinstance(cell, dict):
            print(f"{objective:10s} failed: {cell}")
            continue
        print(f"{objective:10s} {cell['step_s']:8.3f} {cell['peak_mb']:8.1f}")
    if all(isinstance(c, dict) for c in cells.values()):
        ratio = cells["motion"]["step_s"] / cells["labels"]["step_s"]
        print(
            f"motion / labels: {ratio:.2f}x the time, {cells['motion']['peak_mb'] / cells['labels']['peak_mb']:.2f}x the memory"
        )


@dataclasses.dataclass
class Arguments:
    part: str
    families: str
    modalities: str
    presets: str
    seeds: str
    epochs: int
    pretrain_epochs: int
    pretrain_videos: int
    pretrain_set: list
    num_train: int
    set: list
    verbose: bool


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pretraining", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=("families", "probe", "demo", "step"), default="families")
    parser.add_argument("--families", default="match", help="comma-separated, of " + ", ".join(FAMILY_SHAPES))
    parser.add_argument("--modalities", default="motion", help="comma-separated, of " + ", ".join(MODALITIES))
    parser.add_argument("--presets", default="long-range", help="comma-separated, of " + ", ".join(PRESETS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epochs", type=int, default=12, help="epochs of each fine-tuning (and run from scratch)")
    parser.add_argument("--pretrain-epochs", type=int, default=12)
    parser.add_argument(
        "--pretrain-videos", type=int, default=FAMILY_VIDEOS, help="videos the pretraining reads (their labels unused)"
    )
    parser.add_argument("--set", action="append", default=[], help="a config change for every fine-tuning run")
    parser.add_argument(
        "--pretrain-set", action="append", default=[], help="a config change for the pretraining (KEY=VALUE)"
    )
    parser.add_argument("--verbose", action="store_true", help="a line for each run as it ends")
    options = parser.parse_args()
    args = Arguments(**{**vars(options), "num_train": FAMILY_VIDEOS})
    for option, known in (("families", FAMILY_SHAPES), ("modalities", MODALITIES), ("presets", PRESETS)):
        unknown = [name for name in getattr(args, option).split(",") if name not in known]
        if unknown:
            parser.error(f"--{option}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if "order" in args.families.split(","):  # colour only, and not a family of datasets/long_range_tasks.py
        parser.error("--families: order is not pretrained here; choose from the others")
    if args.part == "step":
        step(args)
        return
    if args.part == "demo":
        demo(args)
        return
    cases(args)


if __name__ == "__main__":
    main()
