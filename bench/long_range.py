"""Long-range tasks: what a temporal head learns that short clips and a bag of chunks cannot.

    python -m bench.long_range                  # 4 variants on the order task, 12 epochs each (about 5 minutes)
    python -m bench.long_range --epochs 20 --seeds 0,1,2
    python -m bench.long_range --part families --epochs 30   # every task family and modality, two presets' defaults
    python -m bench.long_range --part families --modalities motion --families match,twice
    python -m bench.long_range --part families --modalities motion --families last --presets long-range --num-train 480
    python -m bench.long_range --part finetune --pretrain last/texture --modalities colour,motion  # from weights
    python -m bench.long_range --part finetune --pretrain last/motion --pretrain-videos 480 --families match --modalities motion
    python -m bench.long_range --part adapters --families middle,last --modalities colour --seeds 0,1,2
    python -m bench.long_range --part separability --families twice --checkpoint runs/.../last.pt  # A and B apart?

--part families: each task family of ``datasets/long_range_tasks.py`` (order: the order of two events, the middle
colour, the last colour, the first of two among distractors; relations between far events: whether the second
attempt was like the first, which colour the first half holds more of, whether the end matches the start: each at
chance for any order-blind pooling, by construction), in each modality (the events told apart by colour, motion,
texture at one brightness or a count of pulses; the order family in colour only), at its own shape (video length,
event length, number of chunks), trained with the head's defaults from two presets (configs/quickstart.yaml with
model.temporal_head: transformer; configs/long-range.yaml) beside the
order-blind baseline (the long-range preset with chunk logits averaged). Printed: best and last validation
accuracy (the mean over seeds, then each seed's), the first epoch at 0.9 or more (the slowest seed's), seconds per
epoch. A preset that flips (quickstart) gets the family's mirrored classes as data.flip_label_pairs (in motion a
mirror swaps A and B); --num-train N writes and trains on N training videos a family instead of 96.

--part finetune: --part families from weights instead of from scratch: the backbone of a run on --pretrain (the
long-range preset's transformer head, no reconstruction) stands in for pretrained weights, and each case
fine-tunes it.

--part adapters: --part finetune's cases, the backbone from --pretrain trained each way (--ways): fine-tuned whole,
frozen with the head alone, and frozen with block, side or LoRA adapters (model.adapter), each with the long-range
preset's head. Printed first: what each way trains of the backbone, as a share of it.

--part separability: how far a backbone's chunk features keep an event's two kinds apart, as the head sees them
(each chunk's contrast against its clip): the nearest-centroid accuracy and a linear probe's held-out accuracy over
the chunks that show one event, of a random backbone or of each --checkpoint's.

Data: ``python -m datasets.synthetic --long-range`` (written to data/long_range if missing): 1,024-frame videos
with two brief events at least 320 frames apart; the label is their order (datasets/long_range_tasks.py says why no
single chunk and no order-blind pooling can beat chance). Each variant is configs/long-range.yaml with:

    (a) short clips     16 frames at stride 4 (64 video frames), one forward, no head
    (b) chunks, mean    the whole video (256 frames at stride 4) in training chunks of 32, chunk logits averaged
    (c) attention       (b) with model.temporal_head: attention
    (d) transformer     (b) with model.temporal_head: transformer

Each runs train.py in a fresh process. Printed: the best and the last validation accuracy, the seconds per epoch
(training and validation, from metrics.csv), and the memory of one training step at the variant's shape measured
as ``python -m bench.train_chunked`` measures it (host RSS growth during the step, batch 1), with the step memory
of (d) at a 1,024-frame clip against a 64-frame one.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from bench.train_chunked import step_cell
from core.files import atomic_path
from core.runtime import compute_threads
from datasets.long_range_tasks import (
    MODALITIES,
    RELATION_EVENTS,
    TASKS,
    generate_long_range,
    generate_task,
    mirrored_classes,
)
from datasets.windows import chunk_windows
from tests.long_range_probes import event_chunks, kinds_apart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG_RANGE_PRESET = os.path.join(ROOT, "configs", "long-range.yaml")
# Each family at its own shape: (clip frames at stride 4, training/inference chunk in clip frames)
FAMILY_SHAPES = {
    "order": (256, 32),
    "middle": (96, 16),
    "last": (160, 8),
    "distractors": (256, 4),
    "twice": (128, 16),
    "more": (192, 8),
    "match": (160, 16),
    "match3": (192, 16),
}
FAMILY_VIDEOS = 96  # training videos a family unless --num-train says otherwise (datasets.synthetic --family's too)
VARIANTS = {
    "(a) short clips": [
        "data.num_frames=16",
        "train.chunk_train_size=-1",
        "infer.chunk_size=-1",
        "model.temporal_head=none",
    ],
    "(b) chunks, mean": ["model.temporal_head=none"],
    "(c) attention": ["model.temporal_head=attention"],
    "(d) transformer": ["model.temporal_head=transformer"],
}


def train_variant(
    overrides: list[str],
    data: str,
    epochs: int,
    seed: int,
    config: str = LONG_RANGE_PRESET,
    keep: str | None = None,
    kept: str = "best.pt",
    metric: str = "val_clip_acc",
) -> dict:
    """One train.py run's validation ``metric`` by epoch; ``keep``: a path to copy its checkpoint ``kept`` to."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "train.py",
            "--config",
            config,
            "--set",
            f"data.data_dir={data}",
            "--set",
            "experiment=long_range",
            "--set",
            f"trainer.output_dir={out}",
            "--set",
            f"train.max_epochs={epochs}",
            "--set",
            f"train.seed={seed}",
        ] + [item for o in overrides for item in ("--set", o)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
        with open(os.path.join(out, "long_range", "latest", "metrics.csv"), newline="") as f:
            rows = list(csv.DictReader(f))
        if keep:
            os.makedirs(os.path.dirname(keep), exist_ok=True)
            with atomic_path(keep) as tmp:
                shutil.copyfile(os.path.join(out, "long_range", "latest", "checkpoints", kept), tmp)
    accuracy = [float(r[metric]) for r in rows]
    elapsed = [float(r["elapsed_s"]) for r in rows]
    reached = next((int(r["epoch"]) for r, a in zip(rows, accuracy) if a >= 0.9), None)
    return {
        "best": max(accuracy),
        "last": accuracy[-1],
        # the label's loss alone where the chunk reconstruction adds its own to train_loss
        "train_loss": float(rows[-1].get("train_label_loss") or rows[-1]["train_loss"]),
        "to_0.9": reached,
        "epoch_s": (elapsed[-1] - elapsed[0]) / max(len(rows) - 1, 1),
        "by_epoch": accuracy,
    }


PRESETS = {
    "quickstart + head": (
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        ["model.temporal_head=transformer", "data.batch_size=8"],
    ),
    "long-range": (LONG_RANGE_PRESET, []),
    "order-blind mean": (LONG_RANGE_PRESET, ["model.temporal_head=none"]),
}


def family_data(
    family: str, root: str, modality: str = "colour", num_train: int = FAMILY_VIDEOS
) -> tuple[str, list[str]]:
    """(the family's data directory in ``modality`` with ``num_train`` training videos, written if missing; its
    manifest and shape overrides)."""
    if family == "order" and modality == "colour":
        data = generate_long_range(os.path.join(root, "long_range"), quiet=True)
        names = ("order_train.jsonl", "order_val.jsonl")
    elif family == "order":  # the order of two events (A, B) as the families draw it
        raise SystemExit("--part families: the order family is colour only; its kin distractors has every modality")
    else:
        folder = f"task_{family}" if modality == "colour" else f"task_{family}_{modality}"
        folder += "" if num_train == FAMILY_VIDEOS else f"_{num_train}"
        data = generate_task(os.path.join(root, folder), family, num_train=num_train, quiet=True, modality=modality)
        names = (f"{family}_train.jsonl", f"{family}_val.jsonl")
    frames, chunk = FAMILY_SHAPES[family]
    return data, [
        f"data.train_manifest={names[0]}",
        f"data.val_manifest={names[1]}",
        "data.test_manifest=null",
        "data.class_names=null",
        # a preset that flips (quickstart) swaps A and B in motion: the family's pairs, none of the preset's classes
        f"data.flip_label_pairs={json.dumps(mirrored_classes(family, modality))}",
        f"data.num_frames={frames}",
        "data.frame_stride=4",
        f"train.chunk_train_size={chunk}",
        "train.chunk_train_overlap=0",
        f"infer.chunk_size={chunk}",
        "infer.chunk_overlap=0",
    ]


def families(args, weights=None, variants: dict | None = None, source: str | None = None) -> None:
    """Each --families x --modalities case from each --presets (or each of ``variants``: {name: (config,
    overrides)}), at each seed; ``weights(seed)``: a checkpoint whose backbone each run starts from
    (model.pretrained), or None for a backbone from scratch; ``source``: where the weights came from, in words."""
    from config import load_config

    variants = variants or {name: PRESETS[name] for name in args.presets.split(",")}
    seeds = [int(s) for s in args.seeds.split(",")]
    width = max(18, *(len(name) for name in variants))
    print(
        # the runs inherit this process's OMP_NUM_THREADS
        f"long-range task families, {args.epochs} epochs, seeds {seeds}, on the CPU ({os.cpu_count()} CPUs, "
        f"{compute_threads()} a run); each "
        f"family's validation set is balanced (chance: 1 / classes); the backbone "
        + ("from scratch" if weights is None else source or f"from {args.pretrain}'s")
    )
    print(
        f"{'family':22s} {'chunks':>6s} {'variant':{width}s} {'best':>6s} {'last':>6s} {'to 0.9':>6s} {'s/epoch':>8s}"
        f"  best, last of each seed"
    )
    cases = [
        (family, modality)
        for modality in args.modalities.split(",")
        for family in args.families.split(",")
        if modality == "colour" or family != "order"
    ]
    for family, modality in cases:
        data, shape = family_data(family, os.path.join(ROOT, "data"), modality, args.num_train)
        label = family if modality == "colour" else f"{family}/{modality}"
        label += "" if args.num_train == FAMILY_VIDEOS else f" x{args.num_train}"
        for name, (config, overrides) in variants.items():
            cfg = load_config(config, shape + overrides + args.set)  # the clip and its chunks as the run reads them
            chunks = len(chunk_windows(cfg.data.num_frames, cfg.train.chunk_train_size, cfg.train.chunk_train_overlap))
            runs = []
            for seed in seeds:
                start = [] if weights is None else [f"model.pretrained={weights(seed)}"]
                r = train_variant(shape + overrides + args.set + start, data, args.epochs, seed, config)
                runs.append(r)
                if args.verbose:
                    print(
                        f"  {label} {name} seed {seed}: best {r['best']:.3f} last {r['last']:.3f} "
                        f"train loss {r['train_loss']:.3f} to 0.9 {r['to_0.9']}; by epoch "
                        + " ".join(f"{a:.3f}" for a in r["by_epoch"]),
                        flush=True,
                    )
            print_summary(f"{label:22s} {chunks:6d} {name:{width}s}", runs)


def print_summary(case: str, runs: list[dict]) -> None:
    """One line of --part families: a case's mean best and last accuracy over its seeds' runs, the slowest seed's
    first epoch at 0.9, the mean seconds per epoch, each seed's best and last."""
    reached = [r["to_0.9"] for r in runs]
    each = " ".join(f"{r['best']:.3f},{r['last']:.3f}" for r in runs)
    print(
        f"{case} {sum(r['best'] for r in runs) / len(runs):6.3f} {sum(r['last'] for r in runs) / len(runs):6.3f} "
        f"{'-' if None in reached else max(reached):>6} {sum(r['epoch_s'] for r in runs) / len(runs):8.1f}  {each}",
        flush=True,
    )


# What the pretraining of --part finetune sets: the long-range preset's head, no auxiliary loss
PRETRAINING = ["model.temporal_head=transformer", "model.chunk_reconstruction=0"]


def finetune(args) -> None:
    """--part families from a backbone trained first on --pretrain (a family in one modality, with the long-range
    preset and a plain transformer head: it stands in for pretrained weights), fine-tuned with the head on each
    case. The pretrained checkpoints are kept in data/long_range_pretrained and reused."""
    families(args, pretrained_weights(args))


def pretrained_weights(args):
    """``weights(seed)``: the checkpoint of a run on --pretrain at that seed (kept in data/long_range_pretrained,
    trained there first if missing)."""
    family, modality = args.pretrain.split("/")
    data, shape = family_data(family, os.path.join(ROOT, "data"), modality, args.pretrain_videos)
    config, overrides = PRESETS["long-range"]
    videos = "" if args.pretrain_videos == FAMILY_VIDEOS else f"_{args.pretrain_videos}videos"

    def weights(seed: int) -> str:
        name = f"{family}_{modality}{videos}_seed{seed}_{args.pretrain_epochs}epochs.pt"
        path = os.path.join(ROOT, "data", "long_range_pretrained", name)
        if not os.path.exists(path):
            run = train_variant(shape + overrides + PRETRAINING, data, args.pretrain_epochs, seed, config, keep=path)
            print(f"  pretrained on {args.pretrain}, seed {seed}: best {run['best']:.3f}", flush=True)
        return path

    return weights


# --part adapters: the ways of training a backbone from --pretrain's weights, each with the long-range preset's head
ADAPTER_WAYS = {
    "fine-tuned": [],
    "frozen": ["model.freeze_backbone=true"],
    "block": ["model.adapter=block"],
    "side": ["model.adapter=side"],
    "lora": ["model.adapter=lora"],
}


def adapters(args) -> None:
    """--part finetune's cases trained each way of ADAPTER_WAYS: the whole backbone, the head alone on it frozen, and
    each kind of adapter on it frozen."""
    from config import load_config
    from models import build_model
    from models.adapters import parameter_counts

    config, overrides = PRESETS["long-range"]
    for way, changes in ADAPTER_WAYS.items():
        adapted, backbone = parameter_counts(build_model(load_config(config, overrides + changes).model, 2))
        print(
            f"{way}: {adapted:,} backbone or adapter parameters trained ({adapted / backbone:.1%} of the backbone's {backbone:,})"
        )
    ways = {way: (config, overrides + changes) for way, changes in ADAPTER_WAYS.items() if way in args.ways.split(",")}
    families(args, pretrained_weights(args), ways)


def separability(args) -> None:
    """``kinds_apart`` of a random backbone (initialized at the first of --seeds) or of each --checkpoint's, on
    the first 48 training videos of each family of --families with two kinds of event, in each of --modalities."""
    from artifacts.checkpoint import load_checkpoint
    from config import load_config, saved_config
    from models import build_model

    print(
        f"{'family':22s} {'A/B accuracy':>12s} {'linear':>7s} {'|A - B| / 2':>12s} {'|events - empty|':>16s}  backbone"
    )
    cases = [(task, modality) for modality in args.modalities.split(",") for task in args.families.split(",")]
    for task, modality in cases:
        if task not in (*RELATION_EVENTS, "last", "distractors"):
            continue  # the order task is not a TASKS family; middle has three kinds of event
        frames, chunk = FAMILY_SHAPES[task]
        data, _ = family_data(task, os.path.join(ROOT, "data"), modality)
        clips, colours = event_chunks(task, data, frames, chunk)
        label = task if modality == "colour" else f"{task}/{modality}"
        for source in args.checkpoint or ["random"]:
            if source == "random":
                cfg = load_config(LONG_RANGE_PRESET, [])
                torch.manual_seed(int(args.seeds.split(",")[0]))
                model = build_model(cfg.model, num_classes=len(TASKS[task]["classes"]))
            else:
                saved = load_checkpoint(source)
                cfg = saved_config(saved.config)
                model = build_model(cfg.model, num_classes=len(saved.class_names))
                model.load_state_dict(saved.model)
            apart = kinds_apart(model, clips, colours, chunk, cfg.data.mean, cfg.data.std)
            print(
                f"{label:22s} {apart['accuracy']:12.3f} {apart['linear']:7.3f} {apart['apart']:12.2f} "
                f"{apart['events']:16.2f}  {source}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.long_range", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--part",
        choices=("order", "families", "finetune", "adapters", "separability"),
        default="order",
    )
    parser.add_argument(
        "--ways", default=",".join(ADAPTER_WAYS), help="--part adapters: which ways of training, comma-separated"
    )
    parser.add_argument(
        "--pretrain",
        default="last/texture",
        help="--part finetune: the FAMILY/MODALITY whose training gives the backbone its weights (last/texture: "
        "a plain head learns it from scratch)",
    )
    parser.add_argument("--pretrain-epochs", type=int, default=12, help="--part finetune: epochs of the pretraining")
    parser.add_argument(
        "--pretrain-videos",
        type=int,
        default=FAMILY_VIDEOS,
        help="--part finetune: training videos of the pretraining (more where the family needs them: last/motion "
        "learns its directions from 480)",
    )
    parser.add_argument(
        "--checkpoint",
        action="append",
        help="--part separability: a training checkpoint whose backbone to measure (repeat for several; none: a "
        "random one, initialized at the first of --seeds)",
    )
    parser.add_argument("--data", default=os.path.join(ROOT, "data", "long_range"), help="the order task's directory")
    parser.add_argument(
        "--num-train",
        type=int,
        default=FAMILY_VIDEOS,
        help="--part families, finetune: training videos a family (48 validate)",
    )
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seeds", default="0", help="train.seed values, comma-separated: accuracy is averaged")
    parser.add_argument("--families", default=",".join(FAMILY_SHAPES), help="--part families: which, comma-separated")
    parser.add_argument("--presets", default=",".join(PRESETS), help="--part families: which variants, comma-separated")
    parser.add_argument(
        "--modalities",
        default=",".join(MODALITIES),
        help="--part families, finetune, separability: what tells the events apart (datasets/long_range_tasks.py), "
        "comma-separated; the order family is colour only",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="--part families: a config change for every run (KEY=VALUE)",
    )
    parser.add_argument("--verbose", action="store_true", help="--part families: a line for each run as it ends")
    args = parser.parse_args()
    for option, known in (
        ("--families", FAMILY_SHAPES),
        ("--presets", PRESETS),
        ("--ways", ADAPTER_WAYS),
        ("--modalities", MODALITIES),
    ):
        unknown = [name for name in getattr(args, option[2:]).split(",") if name not in known]
        if unknown:
            parser.error(f"{option}: unknown {', '.join(repr(n) for n in unknown)}; choose from {', '.join(known)}")
    if args.num_train < 1 or (args.num_train != FAMILY_VIDEOS and "order" in args.families.split(",")):
        parser.error("--num-train: at least 1, and for the families of datasets/long_range_tasks.py (not order)")
    if args.part == "families":
        families(args)
        return
    if args.part == "finetune":
        finetune(args)
        return
    if args.part == "adapters":
        adapters(args)
        return
    if args.part == "separability":
        separability(args)
        return
    generate_long_range(args.data, quiet=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(
        f"long-range order task ({args.data}): 96 training and 48 validation videos of 1,024 frames; "
        f"{args.epochs} epochs, seeds {seeds}, on the CPU ({os.cpu_count()} CPUs); chance is 0.50"
    )
    print(f"{'variant':18s} {'val acc best':>12s} {'val acc last':>12s} {'s/epoch':>8s} {'step MB':>8s} {'clip':>16s}")
    for name, overrides in VARIANTS.items():
        runs = [train_variant(overrides, args.data, args.epochs, seed) for seed in seeds]
        best = sum(r["best"] for r in runs) / len(runs)
        last = sum(r["last"] for r in runs) / len(runs)
        epoch_s = sum(r["epoch_s"] for r in runs) / len(runs)
        short = name.startswith("(a)")
        head = next(o.split("=")[1] for o in overrides if o.startswith("model.temporal_head"))
        memory = step_cell("tiny3d", 16, 32, 16 if short else 256, -1 if short else 32, repeat=1, temporal_head=head)
        step_mb = f"{memory['peak_mb']:8.1f}" if isinstance(memory, dict) else f"{'failed':>8s}"
        clip = "16 frames" if short else "256 in chunks of 32"
        print(f"{name:18s} {best:12.3f} {last:12.3f} {epoch_s:8.1f} {step_mb} {clip:>16s}", flush=True)
    cells = {
        length: step_cell("tiny3d", 16, 32, length, 32, repeat=1, temporal_head="transformer") for length in (64, 1024)
    }
    if all(isinstance(c, dict) for c in cells.values()):
        print(
            f"(d)'s step memory, chunks of 32: {cells[64]['peak_mb']:.1f} MB at a 64-frame clip, "
            f"{cells[1024]['peak_mb']:.1f} MB at 1,024 frames ({cells[1024]['peak_mb'] / cells[64]['peak_mb']:.2f}x)"
        )


if __name__ == "__main__":
    main()
