"""A video's timeline as a picture a person can review: the annotated segments above the predicted ones, in rows of
a fixed span of time (an hour is 12 rows of 5 minutes), the frames where they disagree marked under each row, and
over a video of several rows a strip of the accuracy per minute. One class has one colour in every picture of a run.

Size: at most ``MAX_ROWS`` rows; a video longer than ``MAX_ROWS`` x the row span gets longer rows (in whole
minutes), so a 10-hour video is 24 rows of 25 minutes and every picture stays under about 1,200 x 2,700 pixels.
"""

from __future__ import annotations

import math
import re

import numpy as np

from artifacts.plots import pyplot, save_figure
from datasets.records import label_runs

ROW_MINUTES = 5.0  # infer_chunked.py --plot-row-minutes
MAX_ROWS = 24
PALETTE = "tab20"


def class_colours(class_names: list[str]) -> dict[str, tuple]:
    """One RGBA colour per class, fixed by the class list (the run's, saved with it): a class named after a colour
    matplotlib knows is drawn in it ("red" red); the others take the palette in class order, skipping its colours
    close to a named class's."""
    from matplotlib import colormaps  # lazy: matplotlib loads in a second, only when a picture is drawn
    from matplotlib.colors import is_color_like, to_rgba  # (the same)

    def named(name: str) -> bool:  # "0.5" (a grey) and "C1" (the cycle) are colours to matplotlib, not names
        return is_color_like(name) and not re.fullmatch(r"[\d.]+|C\d+", name)

    colours = {name: to_rgba(name) for name in class_names if named(name)}
    palette = [colormaps[PALETTE](i) for i in range(colormaps[PALETTE].N)]
    free = [c for c in palette if all(np.linalg.norm(np.subtract(c, used)[:3]) > 0.35 for used in colours.values())]
    free = free or palette
    for i, name in enumerate(n for n in class_names if n not in colours):
        colours[name] = free[i % len(free)]
    return colours


def row_seconds(duration_s: float, row_minutes: float = ROW_MINUTES) -> float:
    """Each row's span: ``row_minutes`` (a shorter video: its length), or as many whole minutes as keep the rows to
    MAX_ROWS."""
    span = row_minutes * 60
    if duration_s <= span:
        return max(duration_s, 1e-3)
    if duration_s > span * MAX_ROWS:
        span = math.ceil(duration_s / MAX_ROWS / 60) * 60
    return span


def disagreements(predicted: np.ndarray, truth: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of annotated frames whose predicted label is not the annotated one."""
    wrong = (truth >= 0) & (predicted != truth)
    return [(s, e) for s, e, value in label_runs(wrong.astype(np.int64)) if value]


def nice_step(seconds: float) -> float:
    """A tick step of about a tenth of ``seconds``: 1, 2, 5, 10, 15 or 30 s, or whole minutes of those."""
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if seconds / step <= 12:
            return step
    return 3600 * math.ceil(seconds / 3600 / 12)


def hms(seconds: float, _=None) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def timeline_figure(
    plt,
    predicted: np.ndarray,
    truth: np.ndarray | None,
    class_names: list[str],
    fps: float,
    title: str,
    row_minutes: float = ROW_MINUTES,
):
    """The figure: per-frame ``predicted`` labels (class indices) and ``truth`` (-1: not annotated; None: no
    annotation) in rows; each row an axis, the per-minute accuracy strip (several rows, with truth) first."""
    duration = len(predicted) / fps
    span = row_seconds(duration, row_minutes)
    count = max(1, math.ceil(duration / span))
    bars = [("annotated", truth)] if truth is not None else []
    bars.append(("predicted", predicted))
    summary = truth is not None and count > 1
    heights = ([1.2] if summary else []) + [0.35 + 0.35 * len(bars)] * count
    figure, axes = plt.subplots(
        len(heights), 1, figsize=(12, 0.9 + sum(heights)), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    axes = list(axes[:, 0])
    colours = class_colours(class_names)
    if summary:
        _minute_accuracy(axes.pop(0), predicted, truth, fps)
    wrong = disagreements(predicted, truth) if truth is not None else []
    for r, axis in enumerate(axes):
        start, end = r * span, min((r + 1) * span, duration)
        for y, (_, labels) in enumerate(reversed(bars)):
            for s, e, label in label_runs(labels):
                if label >= 0 and e / fps > start and s / fps < end:
                    axis.broken_barh([(s / fps, (e - s) / fps)], (y + 0.5, 0.9), facecolors=colours[class_names[label]])
        if truth is not None:
            axis.broken_barh(
                [(s / fps, (e - s) / fps) for s, e in wrong if e / fps > start and s / fps < end],
                (0, 0.4),
                facecolors="black",
                label="disagree",
            )
        axis.set_yticks(
            [0.2] * (truth is not None) + [y + 0.95 for y in range(len(bars))],
            ["disagree"] * (truth is not None) + [name for name, _ in reversed(bars)],
            fontsize=8,
        )
        axis.set_xlim(start, start + span)
        axis.set_ylim(0, len(bars) + 0.5)
        axis.xaxis.set_major_formatter(hms)
        axis.xaxis.set_major_locator(plt.MultipleLocator(nice_step(span)))
        axis.tick_params(axis="x", labelsize=8)
    axes[-1].set_xlabel("time (h:mm:ss)")
    shown = sorted({int(v) for _, labels in bars for v in np.unique(labels) if v >= 0})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[class_names[i]]) for i in shown]
    top = figure.axes[0]
    top.legend(
        handles,
        [class_names[i] for i in shown],
        loc="lower left",
        bbox_to_anchor=(0, 1.02),
        fontsize="small",
        frameon=False,
        ncols=min(len(shown), 6),
    )
    figure.suptitle(title, fontsize="medium")
    return figure


def _minute_accuracy(axis, predicted: np.ndarray, truth: np.ndarray, fps: float) -> None:
    """Each minute's share of annotated frames predicted right, over the whole video."""
    from matplotlib.ticker import MultipleLocator  # (lazy, as above)

    per_minute = max(1, int(round(60 * fps)))
    minutes = math.ceil(len(predicted) / per_minute)
    accuracy = []
    for m in range(minutes):
        part = slice(m * per_minute, (m + 1) * per_minute)
        annotated = truth[part] >= 0
        accuracy.append(
            float((predicted[part][annotated] == truth[part][annotated]).mean()) if annotated.any() else np.nan
        )
    axis.bar(np.arange(minutes) * 60 + 30, accuracy, width=54, color="grey")
    axis.set(xlim=(0, minutes * 60), ylim=(0, 1.02))
    axis.set_ylabel("right\nper minute", fontsize=8)
    axis.xaxis.set_major_formatter(hms)
    axis.xaxis.set_major_locator(MultipleLocator(nice_step(minutes * 60)))
    axis.tick_params(labelsize=8)
    axis.grid(alpha=0.3, axis="y")


def timeline_plot(
    path: str,
    predicted: np.ndarray,
    truth: np.ndarray | None,
    class_names: list[str],
    fps: float,
    title: str,
    scores: dict | None = None,
    row_minutes: float = ROW_MINUTES,
) -> str | None:
    """Draw a video's timeline (``timeline_figure``) to ``path``; None where matplotlib is missing."""
    plt = pyplot("--plot")
    if plt is None:
        return None
    if scores:
        title += f"  (frame acc {scores['frame_acc']:.3f}, edit {scores['edit']:.1f}, F1@50 {scores['f1@50']:.1f})"
    return save_figure(timeline_figure(plt, predicted, truth, class_names, fps, title, row_minutes), plt, path)
