"""K-fold cross-validation of video labels: a preset's training videos in K folds, each fold trained on the others and
scored on itself, a row per fold and the mean.

    python -m engine.evaluation.k_fold --config configs/my-videos.yaml --folds 5
    python -m engine.evaluation.k_fold --config configs/my-videos.yaml --folds 5 --set train.max_epochs=10

The videos are those of the preset's data.train_manifest (a labelled one: one label a video; timelines are
cross-validated on their own splits, engine/evaluation/cross_validation.py). With data.group_key every group
(patient, subject) is in one fold; the groups are dealt to the folds class by class (by each group's most common
label), so each fold holds about as many of each class. Fold k trains with train.py on the other folds' videos
(OUT/foldK/train.jsonl; validation on fold k's, OUT/foldK/test.jsonl) in OUT/runs/foldK/, then the model at the end
of its training (last.pt: choosing the best epoch on the fold it is scored on would flatter it) is scored on fold k
by eval.py (OUT/foldK_eval.json and .csv): video accuracy, video accuracy averaged over classes, clip accuracy.
OUT/k_fold.md has the table, OUT/k_fold.json every figure. Run it again after a stop: a fold whose run has
finished is scored again without training, one that stopped part-way continues from its last.pt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections import Counter, defaultdict

from artifacts.checkpoint import CheckpointError
from config import load_config
from core.cli import exit_on_usage_error
from core.errors import UsageError
from core.files import atomic_write_bytes
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.manifest import manifest_entry
from datasets.records import read_split, split_key
from engine.evaluation.fold_runs import score_part, train_part, write_table

COLUMNS = (
    ("video acc", "video_acc"),
    ("video acc, mean over classes", "video_mean_class_acc"),
    ("clip acc", "clip_acc"),
)


def folds_of(records: list, data_cfg, folds: int) -> list[list]:
    """The records in ``folds`` folds: each group (data.group_key, else each video) in one, the groups of each
    class dealt in turn, in an order fixed by a hash of their keys (the same folds every run and machine)."""
    groups: dict[str, list] = defaultdict(list)
    for record in records:
        if record.label is None:
            raise UsageError(
                f"{record.where}: a timeline (segments), not a video label; k-fold cross-validates video labels "
                f"(timelines: python -m engine.evaluation.cross_validation)"
            )
        groups[split_key(record, data_cfg)].append(record)
    if len(groups) < folds:
        raise UsageError(
            f"--folds {folds}: only {len(groups)} {'groups' if data_cfg.group_key else 'videos'} to deal; give at "
            f"most --folds {len(groups)}"
        )
    label_of = {key: Counter(r.label for r in members).most_common(1)[0][0] for key, members in groups.items()}
    order = sorted(groups, key=lambda key: (label_of[key], hashlib.sha1(key.encode()).hexdigest()))
    dealt: list[list] = [[] for _ in range(folds)]
    for turn, key in enumerate(order):
        dealt[turn % folds].extend(groups[key])
    return dealt


def write_fold(out: str, fold: int, folds: list[list]) -> tuple[str, str]:
    """OUT/foldK/train.jsonl (every other fold) and test.jsonl (fold k), their files absolute."""
    folder = os.path.join(out, f"fold{fold}")
    os.makedirs(folder, exist_ok=True)
    train = [r for k, records in enumerate(folds) if k != fold for r in records]
    for name, records in (("train.jsonl", train), ("test.jsonl", folds[fold])):
        lines = "".join(json.dumps(manifest_entry(r)) + "\n" for r in records)
        atomic_write_bytes(os.path.join(folder, name), lines.encode())
    return folder, os.path.join(folder, "test.jsonl")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.evaluation.k_fold",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="the preset to train each fold with")
    parser.add_argument("--folds", type=int, default=5, help="how many folds (default 5)")
    parser.add_argument("--out", help="runs and tables (default: runs/k_fold/<the preset's experiment>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.folds < 2:
        raise UsageError(f"--folds {args.folds}: give 2 or more")
    cfg = load_config(args.config, args.overrides)
    folds = folds_of(read_split(cfg.data, "train"), cfg.data, args.folds)
    out = os.path.abspath(args.out or os.path.join("runs", "k_fold", cfg.experiment))
    os.makedirs(out, exist_ok=True)
    rows, videos = {}, {}
    for fold in range(args.folds):
        folder, test = write_fold(out, fold, folds)
        settings = [
            *args.overrides,
            f"data.data_dir={folder}",
            "data.train_manifest=train.jsonl",
            "data.val_manifest=test.jsonl",
            "data.val_fraction=null",
        ]
        last = train_part(args.config, f"fold{fold}", f"fold {fold}", out, settings)
        metrics = score_part(last, os.path.join(out, f"fold{fold}_eval"), f"fold {fold}", data=test)
        rows[fold] = {name: float(metrics[key]) for name, key in COLUMNS}
        videos[fold] = f"{sum(len(f) for f in folds) - len(folds[fold])} / {len(folds[fold])}"
        print(f"fold {fold}: " + "  ".join(f"{k} {v:.3f}" for k, v in rows[fold].items()), flush=True)
    by = f"grouped by {cfg.data.group_key}" if cfg.data.group_key else "a video a group"
    header = f"{args.config} {' '.join(args.overrides)}".rstrip() + f"; {args.folds} folds, {by}"
    summary = {"config": args.config, "overrides": args.overrides, "group_key": cfg.data.group_key}
    write_table(out, "k_fold", header, ("fold", rows, videos), 3, summary)
    return 0


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS + (CheckpointError,), disk_advice="free space there and run it again")
