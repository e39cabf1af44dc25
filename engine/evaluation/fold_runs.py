"""The parts of a cross-validation (a timeline dataset's splits, engine/evaluation/cross_validation.py; a video-label
set's folds, engine/evaluation/k_fold.py): each trained by train.py and scored by eval.py in a process of its own,
continued or skipped when run again, and the table of the parts and their mean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from artifacts.checkpoint import load_checkpoint
from config import load_config
from core.errors import UsageError
from core.files import atomic_write_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # engine/evaluation/ is two down


def finished(run: str, epochs: int) -> str | None:
    """``run``'s last.pt when it holds the last epoch, else None (no run, or one that stopped part-way)."""
    path = os.path.join(run, "latest", "checkpoints", "last.pt")
    return path if os.path.exists(path) and load_checkpoint(path).state.epoch == epochs else None


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


def train_part(config: str, name: str, label: str, out: str, settings: list[str]) -> str:
    """Train part ``name`` (split1, fold0; ``label`` in the lines printed) with ``settings`` in OUT/runs/NAME, or
    continue it from its last.pt, or skip it when it has finished; its last.pt."""
    experiments = os.path.join(out, "runs")
    settings = [*settings, f"trainer.output_dir={experiments}", f"experiment={name}"]
    epochs = load_config(config, settings).train.max_epochs
    run = os.path.join(experiments, name)
    last = finished(run, epochs)
    if last is not None:
        print(f"{label}: trained already ({last}): scored again", flush=True)
        return last
    command = [sys.executable, os.path.join(ROOT, "train.py"), "--config", config]
    if os.path.exists(os.path.join(run, "latest", "checkpoints", "last.pt")):  # stopped part-way: continue it
        command += ["--resume", "auto"]
    command += [part for setting in settings for part in ("--set", setting)]
    print(f"{label}: training ({epochs} epochs), log in {run}", flush=True)
    run_script(command, f"{label}: train.py")
    last = finished(run, epochs)
    if last is None:
        raise SystemExit(f"{label}: train.py ended without a last.pt of its last epoch in {run}")
    return last


def score_part(last: str, prefix: str, label: str, data: str | None = None) -> dict:
    """eval.py on a part's last.pt (over ``data``, else its config's test set): the metrics of PREFIX.json."""
    command = [sys.executable, os.path.join(ROOT, "eval.py"), "--checkpoint", last, "--output", prefix]
    run_script(command + (["--data", data] if data else []), f"{label}: eval.py")
    with open(prefix + ".json") as f:
        return json.load(f)["metrics"]


def write_table(out: str, name: str, header: str, parts: tuple[str, dict, dict], digits: int, summary: dict) -> None:
    """OUT/NAME.md (``header``, then a row per part and the mean) and OUT/NAME.json (``summary`` and every figure);
    the table printed. ``parts``: what a part is (split, fold), each part's scores, each part's videos (train /
    test)."""
    kind, rows, videos = parts
    mean = {column: sum(row[column] for row in rows.values()) / len(rows) for column in next(iter(rows.values()))}
    lines = [f"| {kind} | videos (train / test) | " + " | ".join(mean) + " |", "|---|---|" + "---:|" * len(mean)]
    for part, row in {**rows, "mean": mean}.items():
        count = videos.get(part, f"{len(rows)} {kind}s")
        lines.append(f"| {part} | {count} | " + " | ".join(f"{row[c]:.{digits}f}" for c in mean) + " |")
    text = "\n".join(lines)
    atomic_write_bytes(os.path.join(out, f"{name}.md"), f"{header}\n\n{text}\n".encode())
    summary = {**summary, f"{kind}s": {str(part): row for part, row in rows.items()}, "mean": mean}
    atomic_write_bytes(os.path.join(out, f"{name}.json"), json.dumps(summary, indent=1).encode())
    print(text)
    print(f"wrote {os.path.join(out, name + '.md')} and {name}.json")
