import json
import os

import cv2
import numpy as np
import pytest
import torch

from datasets.synthetic import CLASSES, generate
from engine.metrics.clips import ClassificationMeter


def small(root, seed):
    return generate(
        str(root),
        seed=seed,
        size=24,
        num_train=6,
        num_val=0,
        num_test=0,
        short_frames=12,
        num_long=1,
        long_frames=100,
        num_multiview=2,
        quiet=True,
    )


def decode(path):
    cap, frames = cv2.VideoCapture(path), []
    while True:
        ok, frame = cap.read()
        if not ok:
            return np.stack(frames)
        frames.append(frame)


def test_generation_is_deterministic_and_complete(tmp_path):
    a, b, c = small(tmp_path / "a", 5), small(tmp_path / "b", 5), small(tmp_path / "c", 6)
    for name in ("train.jsonl", "long.jsonl", "multiview_train.jsonl"):
        assert open(os.path.join(a, name)).read() == open(os.path.join(b, name)).read()
    np.testing.assert_array_equal(
        decode(os.path.join(a, "videos", "train_0000.mp4")), decode(os.path.join(b, "videos", "train_0000.mp4"))
    )
    assert not np.array_equal(
        decode(os.path.join(a, "videos", "train_0000.mp4")), decode(os.path.join(c, "videos", "train_0000.mp4"))
    )
    lines = [json.loads(t) for t in open(os.path.join(a, "train.jsonl"))]
    assert [line["label"] for line in lines] == list(CLASSES)  # balanced, every class
    kpt_files = sorted(os.listdir(os.path.join(a, "keypoints", "train_0000")))
    assert kpt_files[0] == "000000_train_0000.npz" and len(kpt_files) == 12
    long = json.loads(open(os.path.join(a, "long.jsonl")).readline())
    assert long["segments"][0]["start"] == 0 and long["segments"][-1]["end"] == 100
    assert all(s["end"] == t["start"] for s, t in zip(long["segments"], long["segments"][1:]))
    assert np.load(os.path.join(a, "keypoints", "long_00.npy")).shape == (100, 5, 3)
    assert set(json.loads(open(os.path.join(a, "multiview_train.jsonl")).readline())["views"]) == {
        "front",
        "left",
        "right",
    }


def test_a_complete_dataset_is_not_rewritten_and_a_foreign_one_is_refused(tmp_path, capsys):
    root = small(tmp_path / "d", 1)
    before = os.path.getmtime(os.path.join(root, "train.jsonl"))
    generate(
        root,
        seed=1,
        size=24,
        num_train=6,
        num_val=0,
        num_test=0,
        short_frames=12,
        num_long=1,
        long_frames=100,
        num_multiview=2,
    )
    assert "already in" in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(root, "train.jsonl")) == before
    with pytest.raises(SystemExit, match="made with other arguments"):
        small(root, 2)


def test_two_processes_writing_the_same_dataset_at_once_both_get_it(tmp_path):
    """Two benchmarks that start together both write the dataset; the one that finishes second finds the first's
    complete copy and keeps it (it used to fail removing the non-empty directory)."""
    from datasets.video_files import MARKER, build_once

    out, args = str(tmp_path / "d"), {"seed": 1}

    def write(directory):  # the other process completes while this one writes
        build_once(out, args, lambda other: open(os.path.join(other, "from_first"), "w").close(), quiet=True)
        open(os.path.join(directory, "from_second"), "w").close()

    assert build_once(out, args, write, quiet=True) == out
    assert sorted(os.listdir(out)) == sorted([MARKER, "from_first"])
    assert [name for name in os.listdir(tmp_path) if name.startswith(".synthetic-")] == []  # no copy left


def test_a_single_frame_does_not_tell_the_class(tmp_path):
    """Every class starts from shapes of overlapping sizes at random places: the first frames look alike."""
    root = generate(
        str(tmp_path / "s"),
        seed=0,
        size=32,
        num_train=60,
        num_val=0,
        num_test=0,
        short_frames=10,
        num_long=0,
        long_frames=10,
        num_multiview=0,
        quiet=True,
    )
    lines = [json.loads(t) for t in open(os.path.join(root, "train.jsonl"))]
    areas = {}
    for line in lines:
        first = decode(os.path.join(root, line["video"]))[0].max(axis=2)
        areas.setdefault(line["label"], []).append(int((first > first.min() + 30).sum()))
    translation = sorted(a for c in ("left", "right", "up", "down") for a in areas[c])
    assert min(areas["grow"]) < np.median(translation) < max(areas["shrink"])


def test_metrics_equal_a_hand_computation():
    meter = ClassificationMeter(3)
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 1.5], [2.0, 0.0, 1.0], [0.0, 3.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 2, 1])
    videos = torch.tensor([0, 1, 1, 2, 3])
    meter.update(logits[:3], labels[:3], videos[:3])
    meter.update(logits[3:], labels[3:], videos[3:])
    m = meter.compute()
    # predictions 0, 1, 2, 0, 1 against 0, 1, 1, 2, 1
    assert m["confusion"] == [[1, 0, 0], [0, 2, 1], [1, 0, 0]]
    assert m["clip_acc"] == pytest.approx(3 / 5)
    assert "top1" not in m  # one name for top-1 clip accuracy
    assert m["precision"] == pytest.approx([1 / 2, 1.0, 0.0])
    assert m["recall"] == pytest.approx([1.0, 2 / 3, 0.0])
    assert m["f1"] == pytest.approx([2 / 3, 0.8, 0.0])
    assert m["mean_class_acc"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    # top-2 would be different; with 3 classes top-5 is every class
    assert m["top5"] == 1.0
    # video 1 sums softmax([0,2,1]) + softmax([0,1,1.5]) = [0.21, 1.00, 0.79]: class 1 although one clip said 2
    assert m["video_acc"] == pytest.approx(3 / 4) and m["num_videos"] == 4


def test_the_metrics_computed_are_the_names_plots_and_train_monitor_use():
    from typing import get_args

    from config import SCHEMA
    from core.metric_names import CLIP_METRICS, MOTION_METRICS, SEGMENT_METRICS, VALIDATION_PREFIX, Monitored
    from engine.metrics.segments import SegmentationScores

    meter = ClassificationMeter(6)
    meter.update(torch.randn(4, 6), torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 1, 1]))
    assert set(CLIP_METRICS) <= set(meter.compute())
    scores = SegmentationScores()
    scores.add([0, 0, 1], [0, 1, 1])
    assert {f"seg_{name}" for name in scores.result()} == set(SEGMENT_METRICS)  # as evaluation names them
    monitored = get_args(Monitored)
    assert SCHEMA["train"]["monitor"].choices == monitored
    assert {name.removeprefix(VALIDATION_PREFIX) for name in monitored} <= {
        *CLIP_METRICS,
        *SEGMENT_METRICS,
        *MOTION_METRICS,
    }
