"""Cross-validation as the temporal action segmentation field reports it: every split of a dataset in MS-TCN's layout
(Breakfast 4 splits, 50Salads 5, GTEA 4) trained and scored, the per-split table and the mean in the papers' columns.

    python -m engine.evaluation.cross_validation --config configs/mstcn-breakfast.yaml --root /data/bf --splits all
    python -m engine.evaluation.cross_validation --config configs/mstcn-50salads.yaml --root /data/50s --splits all
    python -m engine.evaluation.cross_validation --config configs/mstcn-gtea.yaml --root /data/gtea --splits 1,2

Each split N trains the config's head with train.py (one process a split, data.features_split N: the videos of
splits/train.splitN.bundle) in OUT/runs/splitN/, then the model at the end of training (last.pt: the papers score the
last epoch's model, never the best on the test set) is scored on splits/test.splitN.bundle by eval.py (a process of
its own too, its files OUT/splitN_eval.json and .csv):
F1@10, F1@25, F1@50, edit and frame accuracy (Acc), all in percent, with MS-TCN's definitions
(engine/metrics/segments.py) and data.background_labels left out of edit and F1 (each dataset's preset as MS-TCN's
eval.py). OUT/segmentation.md has the table, OUT/segmentation.json every figure.

Run it again after a stop: a split whose run has finished is scored again without training, one that stopped
part-way continues from its last.pt (train.py --resume auto).
"""

from __future__ import annotations

import argparse
import os

from artifacts.checkpoint import CheckpointError
from core.cli import exit_on_usage_error
from core.errors import UsageError
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.mstcn import bundle_names, split_numbers
from engine.evaluation.fold_runs import ROOT, score_part, train_part, write_table

COLUMNS = (("F1@10", "seg_f1@10"), ("F1@25", "seg_f1@25"), ("F1@50", "seg_f1@50"), ("Edit", "seg_edit"))


def parse_splits(text: str, root: str) -> list[int]:
    have = split_numbers(root)
    if not have:
        raise UsageError(f"--root {root}: no splits/train.splitN.bundle there; is it a dataset in MS-TCN's layout?")
    if text == "all":
        return have
    try:
        wanted = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--splits {text}: expected all or split numbers, e.g. 1,2") from None
    missing = [n for n in wanted if n not in have]
    if missing:
        raise UsageError(f"--splits {text}: {root}/splits has no split {missing[0]} (it has {have})")
    return wanted


def scores_of(metrics: dict) -> dict:
    row = {name: float(metrics[key]) for name, key in COLUMNS}
    row["Acc"] = 100.0 * float(metrics["seg_frame_acc"])
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.evaluation.cross_validation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "mstcn.yaml"), help="the head's preset")
    parser.add_argument("--root", required=True, help="the dataset in MS-TCN's layout (features/, groundTruth/, ...)")
    parser.add_argument("--splits", default="all", help="all, or split numbers: 1,2")
    parser.add_argument("--out", help="runs and tables (default: runs/segmentation/<the root's name>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    args.root = os.path.abspath(args.root)  # the runs' checkpoints record it: eval.py finds it from anywhere
    splits = parse_splits(args.splits, args.root)
    out = args.out or os.path.join("runs", "segmentation", os.path.basename(os.path.abspath(args.root)))
    os.makedirs(out, exist_ok=True)
    rows, videos = {}, {}
    for split in splits:
        settings = [*args.overrides, f"data.features_dir={args.root}", f"data.features_split={split}"]
        last = train_part(args.config, f"split{split}", f"split {split}", out, settings)
        rows[split] = scores_of(score_part(last, os.path.join(out, f"split{split}_eval"), f"split {split}"))
        videos[split] = (
            f"{len(bundle_names(args.root, 'train', split))} / {len(bundle_names(args.root, 'test', split))}"
        )
        print(f"split {split}: " + "  ".join(f"{k} {v:.1f}" for k, v in rows[split].items()), flush=True)
    header = f"{args.root}, {args.config} {' '.join(args.overrides)}".rstrip()
    summary = {"root": os.path.abspath(args.root), "config": args.config, "overrides": args.overrides}
    write_table(out, "segmentation", header, ("split", rows, videos), 1, summary)
    return 0


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS + (CheckpointError,), disk_advice="free space there and run it again")
