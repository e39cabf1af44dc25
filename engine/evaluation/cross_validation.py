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
import json
import os
import subprocess
import sys

from artifacts.checkpoint import CheckpointError, load_checkpoint
from config import load_config
from core.cli import exit_on_usage_error
from core.errors import UsageError
from core.files import atomic_write_bytes
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.mstcn import bundle_names, split_numbers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # engine/evaluation/ is two down
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


def finished(run: str, epochs: int) -> str | None:
    """``run``'s last.pt when it holds the last epoch, else None (no run, or one that stopped part-way)."""
    path = os.path.join(run, "latest", "checkpoints", "last.pt")
    return path if os.path.exists(path) and load_checkpoint(path).state.epoch == epochs else None


def train_split(config: str, root: str, split: int, out: str, overrides: list[str]) -> str:
    """Train split ``split`` (or continue or skip it), and return its last.pt."""
    cfg = load_config(config, [*overrides, f"data.features_dir={root}", f"data.features_split={split}"])
    experiments = os.path.join(out, "runs")
    run = os.path.join(experiments, f"split{split}")
    last = finished(run, cfg.train.max_epochs)
    if last is not None:
        print(f"split {split}: trained already ({last}): scored again", flush=True)
        return last
    settings = [
        *overrides,
        f"data.features_dir={root}",
        f"data.features_split={split}",
        f"trainer.output_dir={experiments}",
        f"experiment=split{split}",
    ]
    command = [sys.executable, os.path.join(ROOT, "train.py"), "--config", config]
    if os.path.exists(os.path.join(run, "latest", "checkpoints", "last.pt")):  # stopped part-way: continue it
        command += ["--resume", "auto"]
    command += [part for setting in settings for part in ("--set", setting)]
    print(f"split {split}: training ({cfg.train.max_epochs} epochs), log in {run}", flush=True)
    run_script(command, f"split {split}: train.py")
    last = finished(run, cfg.train.max_epochs)
    if last is None:
        raise SystemExit(f"split {split}: train.py ended without a last.pt of its last epoch in {run}")
    return last


def run_script(command: list[str], what: str) -> None:
    """One of the project's scripts in a process of its own; its failure is ours, its last line said."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        said = lines[-1].removeprefix("error: ") if lines else done.returncode
        reason = f"{what} failed: {said}"
        if done.returncode == 2:  # a config or data error: ours too, with the same exit code
            raise UsageError(reason)
        raise SystemExit(reason)


def evaluate_split(last: str, split: int, out: str) -> dict:
    """eval.py on a split's last.pt (its test bundle): the metrics of OUT/splitN_eval.json."""
    prefix = os.path.join(out, f"split{split}_eval")
    run_script([sys.executable, os.path.join(ROOT, "eval.py"), "--checkpoint", last, "--output", prefix], "eval.py")
    with open(prefix + ".json") as f:
        return json.load(f)["metrics"]


def scores_of(metrics: dict) -> dict:
    row = {name: float(metrics[key]) for name, key in COLUMNS}
    row["Acc"] = 100.0 * float(metrics["seg_frame_acc"])
    return row


def table(rows: dict, videos: dict) -> str:
    names = [name for name, _ in COLUMNS] + ["Acc"]
    lines = [
        "| split | videos (train / test) | " + " | ".join(names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for split, row in rows.items():
        lines.append(f"| {split} | {videos[split]} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |")
    return "\n".join(lines)


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
        last = train_split(args.config, args.root, split, out, args.overrides)
        rows[split] = scores_of(evaluate_split(last, split, out))
        videos[split] = (
            f"{len(bundle_names(args.root, 'train', split))} / {len(bundle_names(args.root, 'test', split))}"
        )
        print(f"split {split}: " + "  ".join(f"{k} {v:.1f}" for k, v in rows[split].items()), flush=True)
    mean = {name: sum(row[name] for row in rows.values()) / len(rows) for name in next(iter(rows.values()))}
    text = table({**rows, "mean": mean}, {**videos, "mean": f"{len(rows)} splits"})
    header = f"{args.root}, {args.config} {' '.join(args.overrides)}".rstrip()
    atomic_write_bytes(os.path.join(out, "segmentation.md"), f"{header}\n\n{text}\n".encode())
    summary = {"root": os.path.abspath(args.root), "config": args.config, "overrides": args.overrides}
    summary.update(splits={str(k): v for k, v in rows.items()}, mean=mean)
    atomic_write_bytes(os.path.join(out, "segmentation.json"), json.dumps(summary, indent=1).encode())
    print(text)
    print(f"wrote {os.path.join(out, 'segmentation.md')} and segmentation.json")
    return 0


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS + (CheckpointError,), disk_advice="free space there and run it again")
