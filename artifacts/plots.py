"""Plots, drawn once at the end (never every epoch): training curves with the best epoch marked, the confusion
matrix, eval.py --watch's history. matplotlib is a requirement; where it is missing anyway, one note, no plots."""
from __future__ import annotations

import csv

from artifacts.run_dir import RunDirectory
from core.files import atomic_path


def _pyplot(note_prefix: str):
    try:
        import matplotlib  # lazy: a second to import, needed once at the end of a run (and may be missing)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # (the same)
        return plt
    except ImportError:
        print(f"note: {note_prefix} needs matplotlib (pip install matplotlib); no plots written")
        return None


def _save(figure, plt, path: str) -> str:
    figure.tight_layout()
    with atomic_path(path) as tmp:  # a reader never sees half a PNG
        figure.savefig(tmp, dpi=100, format="png")
    plt.close(figure)
    return path


def training_plots(run: RunDirectory, class_names: list[str], confusion: list | None,
                   monitor: str = "val_video_acc", epoch: int | None = None) -> list[str]:
    """training_curves.png from metrics.csv (the best epoch of ``monitor`` marked), and confusion_matrix.png of
    the last validation (``epoch``)."""
    plt = _pyplot("plotting the training curves")
    if plt is None:
        return []
    written = []
    with open(run.metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows:
        written.append(_curves(plt, rows, monitor, f"training of run {run.name}", run.curves_png))
    if confusion is not None:
        written.append(_confusion(plt, confusion, class_names, f"validation confusion matrix, epoch {epoch} "
                                  f"(run {run.name})", run.confusion_png))
    return written


def _curves(plt, rows: list[dict], monitor: str, title: str, path: str) -> str:
    figure, (loss_axis, acc_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    figure.suptitle(title)
    epochs = [int(r["epoch"]) for r in rows]
    loss_axis.plot(epochs, [float(r["train_loss"]) for r in rows], marker="o", label="training loss (mean per clip)")
    loss_axis.set(xlabel="epoch", ylabel="cross-entropy loss", title="training loss")
    labels = {"val_clip_acc": "clip accuracy", "val_video_acc": "video accuracy", "val_top5": "top-5 clip accuracy"}
    for key, label in labels.items():
        points = [(int(r["epoch"]), float(r[key])) for r in rows if r.get(key)]
        if points:
            acc_axis.plot(*zip(*points), marker="o", label=label)
    scored = [(float(r[monitor]), int(r["epoch"])) for r in rows if r.get(monitor)]
    if scored:
        best, best_epoch = max(scored, key=lambda p: (p[0], -p[1]))  # the first epoch with the best value
        acc_axis.axvline(best_epoch, color="grey", linestyle="--", linewidth=1)
        acc_axis.annotate(f"best {labels.get(monitor, monitor)} {best:.3f}\n(epoch {best_epoch}: best.pt)",
                          (best_epoch, best), textcoords="offset points", xytext=(6, -28), fontsize=8)
    acc_axis.set(xlabel="epoch", ylabel="accuracy (share of the validation set)", title="validation",
                 ylim=(-0.02, 1.05))
    for axis in (loss_axis, acc_axis):
        axis.grid(alpha=0.3)
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend(fontsize=8)
    return _save(figure, plt, path)


def _confusion(plt, confusion: list, class_names: list[str], title: str, path: str) -> str:
    size = len(class_names)
    figure, axis = plt.subplots(figsize=(2.5 + 0.65 * size, 1.8 + 0.6 * size))
    image = axis.imshow(confusion, cmap="Blues")
    figure.colorbar(image, ax=axis, label="clips", fraction=0.046, pad=0.04)
    axis.set_xticks(range(size), class_names, rotation=45, ha="right")
    axis.set_yticks(range(size), class_names)
    axis.set(xlabel="predicted class", ylabel="true class", title=title)
    top = max((max(row) for row in confusion), default=0)
    for i, row in enumerate(confusion):
        for j, value in enumerate(row):  # white on dark cells, black on light ones
            axis.text(j, i, str(value), ha="center", va="center", fontsize=8,
                      color="white" if top and value > top / 2 else "black")
    return _save(figure, plt, path)


def eval_history_plot(entries: list[dict], path: str) -> str | None:
    """Accuracy per optimizer step from eval.jsonl entries (eval.py --watch --plot)."""
    plt = _pyplot("--plot")
    if plt is None:
        return None
    entries = sorted((e for e in entries if e.get("status") == "ok"), key=lambda e: e.get("global_step") or 0)
    figure, axis = plt.subplots(figsize=(7.5, 4.2))
    labels = {"clip_acc": "top-1 clip accuracy", "video_acc": "video accuracy", "top5": "top-5 clip accuracy"}
    # "top1": clip_acc's name in eval.jsonl entries written before 2026-11
    metrics = [{"clip_acc": e["metrics"].get("top1"), **e["metrics"]} for e in entries]
    for key, label in labels.items():
        points = [(e["global_step"], m[key]) for e, m in zip(entries, metrics) if m.get(key) is not None]
        if points:
            axis.plot(*zip(*points), marker="o", label=label)
    splits = sorted({e.get("split", "?") for e in entries})
    axis.set(xlabel="optimizer step of the checkpoint", ylabel="accuracy (share of the evaluated set)",
             title=f"eval.py --watch: {len(entries)} checkpoints on {', '.join(splits)}", ylim=(-0.02, 1.05))
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    return _save(figure, plt, path)


def timeline_plot(path: str, predicted: list[dict], truth: list[dict] | None, class_names: list[str], fps: float,
                  num_frames: int, title: str, scores: dict | None = None) -> str | None:
    """A video's timeline: the annotated segments (where there are) above the predicted ones, one colour per class
    (the same in both rows and in every picture of a run), time in seconds."""
    plt = _pyplot("--plot")
    if plt is None:
        return None
    colours = plt.get_cmap("tab20" if len(class_names) > 10 else "tab10")
    rows = ([("annotated", truth)] if truth is not None else []) + [("predicted", predicted)]
    figure, axis = plt.subplots(figsize=(11, 0.8 + 0.7 * len(rows)))
    for y, (_, segments) in enumerate(reversed(rows)):
        for seg in segments:
            index = class_names.index(seg["label"])
            axis.broken_barh([(seg["start"] / fps, (seg["end"] - seg["start"]) / fps)], (y + 0.1, 0.8),
                             facecolors=colours(index % colours.N))
    axis.set_yticks([y + 0.5 for y in range(len(rows))], [name for name, _ in reversed(rows)])
    axis.set_xlim(0, num_frames / fps)
    axis.set_ylim(0, len(rows))
    axis.set_xlabel("time (s)")
    shown = sorted({class_names.index(seg["label"]) for _, segments in rows for seg in segments})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(i % colours.N)) for i in shown]
    axis.legend(handles, [class_names[i] for i in shown], loc="upper left", bbox_to_anchor=(1.01, 1.0),
                fontsize="small", frameon=False)
    if scores:
        title += (f"  (frame acc {scores['frame_acc']:.3f}, edit {scores['edit']:.1f}, "
                  f"F1@50 {scores['f1@50']:.1f})")
    axis.set_title(title, fontsize="medium")
    return _save(figure, plt, path)
