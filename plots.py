"""Plots, drawn once at the end (never every epoch). matplotlib is optional: without it, one note and no plots."""
from __future__ import annotations

import csv
import os


def _pyplot(note_prefix: str):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print(f"note: {note_prefix} needs matplotlib (pip install matplotlib); no plots written")
        return None


def _save(figure, plt, path: str) -> str:
    tmp = os.path.join(os.path.dirname(path) or ".", "." + os.path.basename(path) + ".tmp.png")
    figure.tight_layout()
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    os.replace(tmp, path)  # a reader never sees half a PNG
    return path


def training_plots(run_dir: str, class_names: list[str], confusion: list | None) -> list[str]:
    """training_curves.png from metrics.csv, and confusion_matrix.png of the last validation."""
    plt = _pyplot("plotting the training curves")
    if plt is None:
        return []
    written = []
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    if rows:
        figure, (loss_axis, acc_axis) = plt.subplots(1, 2, figsize=(10, 4))
        epochs = [int(r["epoch"]) for r in rows]
        loss_axis.plot(epochs, [float(r["train_loss"]) for r in rows], marker="o", label="train loss")
        loss_axis.set_xlabel("epoch")
        loss_axis.legend()
        for key in ("val_clip_acc", "val_video_acc", "val_top5"):
            points = [(int(r["epoch"]), float(r[key])) for r in rows if r.get(key)]
            if points:
                acc_axis.plot(*zip(*points), marker="o", label=key)
        acc_axis.set_xlabel("epoch")
        acc_axis.legend()
        written.append(_save(figure, plt, os.path.join(run_dir, "training_curves.png")))
    if confusion is not None:
        figure, axis = plt.subplots(figsize=(1.0 + 0.6 * len(class_names), 0.8 + 0.6 * len(class_names)))
        axis.imshow(confusion, cmap="Blues")
        axis.set_xticks(range(len(class_names)), class_names, rotation=45, ha="right")
        axis.set_yticks(range(len(class_names)), class_names)
        axis.set_xlabel("predicted")
        axis.set_ylabel("true")
        for i, row in enumerate(confusion):
            for j, value in enumerate(row):
                axis.text(j, i, str(value), ha="center", va="center", fontsize=8)
        written.append(_save(figure, plt, os.path.join(run_dir, "confusion_matrix.png")))
    return written


def eval_history_plot(entries: list[dict], path: str) -> str | None:
    """Accuracy per optimizer step from eval.jsonl entries (eval.py --watch --plot)."""
    plt = _pyplot("--plot")
    if plt is None:
        return None
    entries = sorted((e for e in entries if e.get("status") == "ok"), key=lambda e: e.get("global_step") or 0)
    figure, axis = plt.subplots(figsize=(7, 4))
    for key in ("top1", "video_acc", "top5"):
        points = [(e["global_step"], e["metrics"][key]) for e in entries if key in e["metrics"]]
        if points:
            axis.plot(*zip(*points), marker="o", label=key)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("accuracy")
    axis.legend()
    axis.grid(alpha=0.3)
    return _save(figure, plt, path)
