"""What the pictures show: the monitored metric's curve, long timelines in rows with their errors marked, one colour
per class in every picture."""

import matplotlib
import numpy as np
import pytest

from artifacts import plots
from artifacts.timeline_plot import MAX_ROWS, class_colours, disagreements, row_seconds, timeline_figure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend)

CLASSES = [
    "red",
    "green",
    "blue",
    "red_after_green",
    "red_after_blue",
    "green_after_red",
    "green_after_blue",
    "blue_after_red",
    "blue_after_green",
]


def metrics_rows(f1: list[float]) -> list[dict]:
    """metrics.csv's rows as csv.DictReader gives them: a timeline run with one clip per video."""
    return [
        {
            "epoch": str(e),
            "train_loss": str(2.0 / e),
            "val_clip_acc": "1.0",
            "val_video_acc": "1.0",
            "val_top5": "1.0",
            "val_seg_frame_acc": str(0.4 + 0.1 * e),
            "val_seg_edit": str(10.0 * e),
            "val_seg_f1@10": str(12.0 * e),
            "val_seg_f1@25": str(11.0 * e),
            "val_seg_f1@50": str(value),
        }
        for e, value in enumerate(f1, start=1)
    ]


def test_the_curves_draw_the_monitored_metric_and_the_timeline_scores_not_the_accuracies_that_cannot_move():
    rows = metrics_rows([6.9, 33.3, 75.0, 70.2])
    figure = plots.curves_figure(plt, rows, "val_seg_f1@50", "run")
    loss, monitored, others = figure.axes
    (line,) = monitored.get_lines()[:1]
    assert list(line.get_xdata()) == [1, 2, 3, 4] and list(line.get_ydata()) == [6.9, 33.3, 75.0, 70.2]
    marker = [x for x in monitored.get_lines()[1:] if list(x.get_xdata()) == [3, 3]]
    assert marker, "best.pt's epoch (3) is marked"
    assert "best 75.0" in monitored.texts[0].get_text() and "epoch 3" in monitored.texts[0].get_text()
    drawn = {line.get_label(): list(line.get_ydata()) for line in others.get_lines()}
    assert drawn["frame accuracy"] == pytest.approx([50.0, 60.0, 70.0, 80.0])  # a share of frames, in percent
    assert set(drawn) == {"frame accuracy", "edit", "F1@10", "F1@25"}  # no clip accuracy at a constant 1.000
    plt.close(figure)


def test_a_constant_metric_is_named_and_not_drawn_and_a_run_without_segments_shows_its_accuracies():
    rows = [
        {
            "epoch": str(e),
            "train_loss": "1.0",
            "val_clip_acc": str(0.1 * e),
            "val_video_acc": str(0.2 * e),
            "val_top5": "1.0",
        }
        for e in (1, 2, 3)
    ]
    figure = plots.curves_figure(plt, rows, "val_video_acc", "run")
    _, monitored, others = figure.axes
    assert list(monitored.get_lines()[0].get_ydata()) == pytest.approx([0.2, 0.4, 0.6])
    assert [line.get_label() for line in others.get_lines()] == ["clip accuracy"]
    assert "top-5 clip accuracy constant at 1.000: not drawn" in others.get_xlabel()
    plt.close(figure)


def test_with_an_auxiliary_loss_the_label_s_loss_is_drawn_beside_the_whole_loss():
    rows = [
        {
            "epoch": str(e),
            "train_loss": str(3.5 - 0.1 * e),
            "train_label_loss": str(0.7 - 0.1 * e),
            "val_clip_acc": "0.5",
        }
        for e in (1, 2, 3)
    ]
    figure = plots.curves_figure(plt, rows, "val_clip_acc", "run")
    loss = figure.axes[0]
    assert [line.get_label() for line in loss.get_lines()] == [
        "training loss (mean per clip)",
        "the label's loss alone",
    ]
    assert list(loss.get_lines()[1].get_ydata()) == pytest.approx([0.6, 0.5, 0.4]) and loss.get_ylabel() == "loss"
    plt.close(figure)
    without = plots.curves_figure(
        plt, [{k: v for k, v in r.items() if k != "train_label_loss"} for r in rows], "val_clip_acc", "run"
    )
    assert len(without.axes[0].get_lines()) == 1 and without.axes[0].get_ylabel() == "cross-entropy loss"
    plt.close(without)


def hour_of_labels(frames: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    truth = np.repeat(rng.integers(0, len(CLASSES), frames // 50 + 1), 50)[:frames]
    truth[:10] = -1  # not annotated: never a disagreement
    predicted = truth.copy()
    for start in rng.integers(0, frames - 40, 30):
        predicted[start : start + int(rng.integers(1, 40))] = rng.integers(0, len(CLASSES))
    predicted[:10] = 0
    return predicted, truth


@pytest.mark.parametrize("minutes,rows", [(60, 12), (10, 2), (0.4, 1), (600, MAX_ROWS)])
def test_a_long_timeline_is_drawn_in_rows_of_five_minutes_and_ten_hours_stay_bounded(minutes, rows):
    fps = 25.0 if minutes < 600 else 1.0  # ten hours at 1 fps: the same rows, fewer frames to draw
    predicted, truth = hour_of_labels(int(minutes * 60 * fps))
    figure = timeline_figure(plt, predicted, truth, CLASSES, fps, "video")
    summary = rows > 1  # the accuracy per minute over the whole video, above the rows
    assert len(figure.axes) == rows + summary
    width, height = figure.get_size_inches() * 100
    assert width <= 1200 and height <= 2800
    first_row = figure.axes[1 if summary else 0]
    assert first_row.get_xlim() == pytest.approx((0, row_seconds(minutes * 60)))
    if minutes == 600:
        assert row_seconds(minutes * 60) == 25 * 60  # 24 rows of 25 minutes
    plt.close(figure)


def test_the_disagreement_marks_cover_exactly_the_annotated_frames_predicted_wrong():
    fps = 25.0
    predicted, truth = hour_of_labels(int(12 * 60 * fps), seed=1)
    figure = timeline_figure(plt, predicted, truth, CLASSES, fps, "video")
    marked = np.zeros(len(predicted), dtype=bool)
    for axis in figure.axes[1:]:
        for collection in axis.collections:
            if collection.get_label() == "disagree":
                for path in collection.get_paths():
                    xs = path.vertices[:, 0]
                    marked[int(round(xs.min() * fps)) : int(round(xs.max() * fps))] = True
    expected = (truth >= 0) & (predicted != truth)
    assert expected.sum() > 100 and np.array_equal(marked, expected)
    assert disagreements(np.array([0, 1, 1, 2]), np.array([-1, 1, 2, 1])) == [(2, 4)]
    plt.close(figure)


def test_a_class_has_one_colour_in_every_picture_and_a_colour_name_is_drawn_in_its_colour():
    colours = class_colours(CLASSES)
    assert colours["red"] == (1.0, 0.0, 0.0, 1.0) and colours["blue"] == (0.0, 0.0, 1.0, 1.0)
    assert len(set(colours.values())) == len(CLASSES)
    pictures = []
    for kept in (CLASSES, ["blue_after_red", "green"]):  # two videos showing different classes
        predicted = np.repeat([CLASSES.index(name) for name in kept], 100)
        figure = timeline_figure(plt, predicted, predicted.copy(), CLASSES, 25.0, "video")
        legend = figure.axes[0].get_legend()
        pictures.append(
            {
                text.get_text(): tuple(patch.get_facecolor())
                for text, patch in zip(legend.get_texts(), legend.get_patches())
            }
        )
        plt.close(figure)
    for name in ("blue_after_red", "green"):
        assert pictures[0][name] == pictures[1][name] == pytest.approx(colours[name])
