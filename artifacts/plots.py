"""Plots, drawn once at the end (never every epoch): training curves of the monitored metric with best.pt's epoch
marked, the confusion matrix, eval.py --watch's history (timelines: artifacts/timeline_plot.py). matplotlib is a
requirement; where it is missing anyway, one note, no plots."""

from __future__ import annotations

import csv

from artifacts.run_dir import RunDirectory
from core.files import atomic_path
from core.metric_names import CLIP_METRICS, MOTION_METRICS, SEGMENT_METRICS, VALIDATION_PREFIX


def pyplot(note_prefix: str):
    try:
        import matplotlib  # lazy: a second to import, needed once at the end of a run (and may be missing)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # (the same)

        return plt
    except ImportError:
        print(f"note: {note_prefix} needs matplotlib (pip install matplotlib); no plots written")
        return None


def save_figure(figure, plt, path: str) -> str:
    figure.tight_layout()
    with atomic_path(path) as tmp:  # a reader never sees half a PNG
        figure.savefig(tmp, dpi=100, format="png")
    plt.close(figure)
    return path


def training_plots(
    run: RunDirectory,
    class_names: list[str],
    confusion: list | None,
    monitor: str = "val_video_acc",
    epoch: int | None = None,
) -> list[str]:
    """training_curves.png from metrics.csv (the best epoch of ``monitor`` marked), and confusion_matrix.png of
    the last validation (``epoch``)."""
    plt = pyplot("plotting the training curves")
    if plt is None:
        return []
    written = []
    with open(run.metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows:
        written.append(_curves(plt, rows, monitor, f"training of run {run.name}", run.curves_png))
    if confusion is not None:
        written.append(
            _confusion(
                plt,
                confusion,
                class_names,
                f"validation confusion matrix, epoch {epoch} (run {run.name})",
                run.confusion_png,
            )
        )
    return written


# metrics.csv's validation columns: frame accuracy is a share of the frames, the other timeline scores are on the
# field's 0-100 scale: drawn as percentages
CLIP_COLUMNS = {VALIDATION_PREFIX + name: label for name, label in CLIP_METRICS.items()}
SEGMENT_COLUMNS = {VALIDATION_PREFIX + name: label for name, label in SEGMENT_METRICS.items()}
MOTION_COLUMNS = {VALIDATION_PREFIX + name: label for name, label in MOTION_METRICS.items()}


def metric_label(key: str) -> str:
    return {**CLIP_COLUMNS, **SEGMENT_COLUMNS, **MOTION_COLUMNS}.get(key, key)


def percent_scale(key: str) -> float:
    """What ``key``'s values are multiplied by to be drawn: frame accuracy (a share) joins the other timeline
    scores in percent."""
    return 100.0 if key.endswith("seg_frame_acc") else 1.0


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(epoch, value) of ``key`` in metrics.csv's rows, where it was measured; segment scores in percent."""
    return [(int(r["epoch"]), float(r[key]) * percent_scale(key)) for r in rows if r.get(key) not in (None, "")]


def curves_figure(plt, rows: list[dict], monitor: str, title: str):
    """Training loss; the monitored metric (what picks best.pt), its best epoch marked; then the other validation
    metrics that move: the timeline scores where validation has segments, else the accuracies. A metric constant
    over the run (video accuracy with one clip per video, top-5 of five classes) is named, not drawn."""
    segments = any(r.get("val_seg_f1@50") not in (None, "") for r in rows)
    others = [k for k in (SEGMENT_COLUMNS if segments else CLIP_COLUMNS) if k != monitor and series(rows, k)]
    constant = [k for k in others if len({v for _, v in series(rows, k)}) == 1]
    moving = [k for k in others if k not in constant]
    panels = 2 + bool(moving or constant)
    figure, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    loss_axis, monitor_axis = axes[0][:2]
    figure.suptitle(title)
    epochs = [int(r["epoch"]) for r in rows]
    loss_axis.plot(epochs, [float(r["train_loss"]) for r in rows], marker="o", label="training loss (mean per clip)")
    label_only = series(rows, "train_label_loss")  # with an auxiliary loss (the chunk reconstruction) in train_loss
    if label_only:
        loss_axis.plot(*zip(*label_only), marker=".", label="the label's loss alone")
    loss_axis.set(
        xlabel="epoch",
        ylabel="loss" if label_only or monitor in MOTION_COLUMNS else "cross-entropy loss",
        title="training loss",
    )
    percent = monitor.startswith("val_seg_")
    scored = series(rows, monitor)
    if scored:
        monitor_axis.plot(*zip(*scored), marker="o", color="tab:red", label=metric_label(monitor))
        best_epoch, best = max(scored, key=lambda p: (p[1], -p[0]))  # the first epoch with the best value
        monitor_axis.axvline(best_epoch, color="grey", linestyle="--", linewidth=1)
        shown = f"{best:.1f}" if percent else f"{best:.3f}"
        right = best_epoch > (epochs[0] + epochs[-1]) / 2  # the note on the side with room
        monitor_axis.annotate(
            f"best {shown}\n(epoch {best_epoch}: best.pt)",
            (best_epoch, best),
            textcoords="offset points",
            xytext=(-6 if right else 6, -28),
            fontsize=8,
            ha="right" if right else "left",
        )
    monitor_axis.set(
        xlabel="epoch",
        title=f"{metric_label(monitor)} (train.monitor: {monitor})",
        ylabel="percent" if percent else "share of the validation set",
    )
    if panels == 3:
        other_axis = axes[0][2]
        for key in moving:
            other_axis.plot(*zip(*series(rows, key)), marker="o", label=metric_label(key))
        note = "; ".join(f"{metric_label(k)} constant at {series(rows, k)[0][1]:.3f}: not drawn" for k in constant)
        other_axis.set(
            xlabel="epoch" + (f"\n({note})" if note else ""),
            ylabel="percent" if segments else "share of the validation set",
            title="validation: timeline scores" if segments else "validation",
        )
    for axis in axes[0]:
        axis.grid(alpha=0.3)
        axis.xaxis.get_major_locator().set_params(integer=True)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    return figure


def _curves(plt, rows: list[dict], monitor: str, title: str, path: str) -> str:
    return save_figure(curves_figure(plt, rows, monitor, title), plt, path)


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
            axis.text(
                j,
                i,
                str(value),
                ha="center",
                va="center",
                fontsize=8,
                color="white" if top and value > top / 2 else "black",
            )
    return save_figure(figure, plt, path)


def eval_history_plot(entries: list[dict], path: str) -> str | None:
    """Accuracy per optimizer step from eval.jsonl entries (eval.py --watch --plot)."""
    plt = pyplot("--plot")
    if plt is None:
        return None
    entries = sorted((e for e in entries if e.get("status") == "ok"), key=lambda e: e.get("global_step") or 0)
    figure, axis = plt.subplots(figsize=(7.5, 4.2))
    metrics = [e["metrics"] for e in entries]
    timelines = any(m.get("seg_f1@50") is not None for m in metrics)  # scored as timelines: those scores, in percent
    labels = SEGMENT_METRICS if timelines else {**CLIP_METRICS, **MOTION_METRICS}
    for key, label in labels.items():
        points = [
            (e["global_step"], m[key] * percent_scale(key)) for e, m in zip(entries, metrics) if m.get(key) is not None
        ]
        if points:
            axis.plot(*zip(*points), marker="o", label=label)
    splits = sorted({e.get("split", "?") for e in entries})
    axis.set(
        xlabel="optimizer step of the checkpoint",
        ylabel="percent (timeline scores)" if timelines else "accuracy (share of the evaluated set)",
        title=f"eval.py --watch: {len(entries)} checkpoints on {', '.join(splits)}",
        ylim=(-2, 105) if timelines else (-0.02, 1.05),
    )
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    return save_figure(figure, plt, path)
