"""The temporal action segmentation metrics (engine/metrics/segments.py) against cases computed by hand."""

import pytest

from engine.metrics.segments import SegmentationScores, edit_score, f1_counts, segments_of


def frames(*runs):
    """frames(("A", 4), ("B", 1)) -> ["A", "A", "A", "A", "B"]"""
    return [label for label, count in runs for _ in range(count)]


TRUTH_AB = frames(("A", 10), ("B", 10))
FLICKER = frames(("A", 4), ("B", 1), ("A", 5), ("B", 10))  # 19 of 20 frames right, 4 segments for 2


def test_segments_are_runs_with_end_exclusive_and_background_left_out():
    labels = frames(("bg", 2), ("A", 3), ("bg", 1), ("A", 2))
    assert segments_of(labels) == [("bg", 0, 2), ("A", 2, 5), ("bg", 5, 6), ("A", 6, 8)]
    assert segments_of(labels, background=("bg",)) == [("A", 2, 5), ("A", 6, 8)]


def test_over_segmentation_scores_high_frame_accuracy_and_a_low_edit_score():
    scores = SegmentationScores().add(FLICKER, TRUTH_AB)
    assert scores["frame_acc"] == 0.95
    assert scores["edit"] == 50.0  # [A, B, A, B] against [A, B]: 2 insertions over 4
    # @50: A[0,4) IoU 0.4 misses, B[4,5) IoU 0 misses, A[5,10) IoU 0.5 hits, B[10,20) hits: tp 2, fp 2, fn 0
    assert f1_counts(FLICKER, TRUTH_AB, 0.5) == (2, 2, 0)
    assert scores["f1@50"] == pytest.approx(200 / 3)


def test_a_true_segment_matched_twice_counts_once():
    # @25: A[0,4) (IoU 0.4) takes the true A first; A[5,10) (IoU 0.5) finds it taken: a false positive
    assert f1_counts(FLICKER, TRUTH_AB, 0.25) == (2, 2, 0)
    assert f1_counts(frames(("A", 10), ("B", 10)), TRUTH_AB, 0.25) == (2, 0, 0)


def test_a_missed_segment_is_a_false_negative_and_an_edit():
    truth = frames(("A", 10), ("B", 5), ("C", 5))
    predicted = frames(("A", 15), ("C", 5))
    scores = SegmentationScores().add(predicted, truth)
    assert scores["frame_acc"] == 0.75
    assert scores["edit"] == pytest.approx(200 / 3)  # one deletion over 3
    assert f1_counts(predicted, truth, 0.5) == (2, 0, 1)  # A IoU 10/15, C IoU 1; B missed
    assert scores["f1@50"] == pytest.approx(80.0)  # P 1, R 2/3


def test_background_is_left_out_of_edit_and_f1_but_not_of_frame_accuracy():
    truth = frames(("bg", 5), ("A", 10), ("bg", 5))
    predicted = frames(("A", 20))
    with_bg = SegmentationScores().add(predicted, truth)
    assert (with_bg["frame_acc"], with_bg["edit"], with_bg["f1@50"]) == (0.5, pytest.approx(100 / 3), 50.0)
    without = SegmentationScores(background=("bg",)).add(predicted, truth)
    assert (without["frame_acc"], without["edit"], without["f1@50"]) == (0.5, 100.0, 100.0)  # IoU 10/20 = 0.5


def test_a_single_segment_video():
    assert SegmentationScores().add(frames(("A", 8)), frames(("A", 8))) == {
        "frame_acc": 1.0,
        "edit": 100.0,
        "f1@10": 100.0,
        "f1@25": 100.0,
        "f1@50": 100.0,
    }
    assert SegmentationScores().add(frames(("B", 8)), frames(("A", 8))) == {
        "frame_acc": 0.0,
        "edit": 0.0,
        "f1@10": 0.0,
        "f1@25": 0.0,
        "f1@50": 0.0,
    }
    assert edit_score([], []) == 100.0


def test_over_a_split_f1_sums_the_counts_and_edit_averages_the_videos():
    split = SegmentationScores()
    split.add(FLICKER, TRUTH_AB)
    split.add(frames(("A", 15), ("C", 5)), frames(("A", 10), ("B", 5), ("C", 5)))
    result = split.result()
    assert result["frame_acc"] == (19 + 15) / 40
    assert result["edit"] == pytest.approx((50 + 200 / 3) / 2)
    precision, recall = 4 / 6, 4 / 5  # @50: tp 2 + 2, fp 2 + 0, fn 0 + 1
    assert result["f1@50"] == pytest.approx(2 * precision * recall / (precision + recall) * 100)
    with pytest.raises(ValueError, match="3 predicted frame labels for 2 true ones"):
        split.add(["A"] * 3, ["A"] * 2)


def test_background_labels_are_checked_against_the_classes():
    from core.errors import ConfigError
    from engine.metrics.segments import background_indices

    assert background_indices(["idle"], ["walk", "idle", "run"]) == (1,)
    assert background_indices([], ["walk"]) == ()
    with pytest.raises(ConfigError) as info:
        background_indices(["idle", "sit"], ["walk", "run"])
    assert str(info.value) == (
        "data.background_labels names idle, sit, not a class of this model (walk, run); give "
        "labels from that list, or [] for none"
    )
