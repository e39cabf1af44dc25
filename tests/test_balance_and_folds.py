"""Long videos of unequal length and classes of unequal size: data.balance draws each video (or class) alike; a
group key (patient, subject) keeps a group on one side of data.val_fraction and in one fold of the k-fold command,
which trains and scores every fold."""

import csv
import json
import os
from collections import Counter

import pytest
from conftest import BASE_CONFIG, run_python

from config import load_config
from datasets.manifest import ManifestError
from datasets.records import training_records
from datasets.sampler import EpochSampler
from datasets.video_dataset import VideoWindowDataset

CLASSES = ["down", "grow", "left"]


def manifest(synthetic_root, folder, rows) -> str:
    """A JSONL manifest of the synthetic clips: rows of (video file, label, patient)."""
    path = os.path.join(folder, "videos.jsonl")
    with open(path, "w") as f:
        for video, label, patient in rows:
            entry = {"video": os.path.join(synthetic_root, "videos", video), "label": label, "patient": patient}
            f.write(json.dumps(entry) + "\n")
    return path


@pytest.fixture
def unequal(synthetic_root, tmp_path):
    """The 300-frame video labelled "down" (30 sample windows of 10 frames) beside 20-frame clips (2 windows
    each): 1 + 2 "down" videos, 3 "grow", 1 "left"."""
    rows = [("long_00.mp4", "down", "a"), ("train_0000.mp4", "down", "a"), ("train_0006.mp4", "down", "b")]
    rows += [(f"train_00{n:02d}.mp4", "grow", "c") for n in (1, 7, 13)] + [("train_0002.mp4", "left", "d")]
    path = manifest(synthetic_root, tmp_path, rows)
    changes = [f"data.train_manifest={path}", "data.val_manifest=null", "data.max_video_frames=10", "data.num_frames=4"]
    cfg = load_config(BASE_CONFIG, changes)
    records, _ = training_records(cfg.data)
    return VideoWindowDataset(records, CLASSES, cfg.data, training=True)


def drawn(dataset, balance: str, epochs: int = 300) -> tuple[Counter, Counter]:
    """How often each video and each class was drawn over ``epochs`` epochs of the balanced sampler."""
    sampler = EpochSampler(len(dataset), shuffle=True, seed=0, weights=dataset.balance_weights(balance))
    videos, classes = Counter(), Counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for index in sampler:
            window = dataset.windows[index]
            videos[window.record] += 1
            classes[window.label] += 1
    return videos, classes


def test_balance_draws_each_video_or_each_class_alike(unequal):
    assert len(unequal) == 30 + 6 * 2
    for balance in ("videos", "classes"):
        weights = unequal.balance_weights(balance)
        video_of = [w.record for w in unequal.windows]
        per_video = [float(sum(weights[i] for i in range(len(weights)) if video_of[i] == v)) for v in range(7)]
        if balance == "videos":
            assert per_video == pytest.approx([per_video[0]] * 7)  # the long video weighs as a short one
        else:
            per_class = [sum(per_video[v] for v in range(7) if unequal.records[v].label == c) for c in CLASSES]
            assert per_class == pytest.approx([per_class[0]] * 3)  # 3, 3 and 1 videos: each class alike
    videos, _ = drawn(unequal, "videos")
    assert max(videos.values()) / min(videos.values()) < 1.2  # without balance: 15x (30 windows against 2)
    _, classes = drawn(unequal, "classes")
    assert max(classes.values()) / min(classes.values()) < 1.2


def test_a_balanced_epoch_resumes_mid_way_with_the_same_draw(unequal):
    sampler = EpochSampler(len(unequal), shuffle=True, seed=4, weights=unequal.balance_weights("classes"))
    sampler.set_epoch(3)
    whole = list(sampler)
    sampler.set_epoch(3, start=17)
    assert list(sampler) == whole[17:]
    sampler.set_epoch(4)
    assert list(sampler) != whole


def test_the_group_key_keeps_a_patient_on_one_side_of_the_split(synthetic_root, tmp_path):
    rows = [(f"train_00{n:02d}.mp4", CLASSES[n % 3], f"patient{n % 6}") for n in range(18)]
    path = manifest(synthetic_root, tmp_path, rows)
    changes = [f"data.train_manifest={path}", "data.val_fraction=0.4", "data.group_key=patient"]
    train, val = training_records(load_config(BASE_CONFIG, changes).data)
    assert train and val and len(train) + len(val) == 18
    assert not {r.extra["patient"] for r in train} & {r.extra["patient"] for r in val}
    by_path, _ = training_records(load_config(BASE_CONFIG, changes[:2]).data)  # without the key: by path
    assert {r.first_path for r in by_path} != {r.first_path for r in train}
    with open(tmp_path / "videos.csv", "w", newline="") as f:  # a CSV's extra column is the key as well
        writer = csv.writer(f)
        writer.writerow(["video", "label", "patient"])
        writer.writerows([os.path.join(synthetic_root, "videos", v), label, p] for v, label, p in rows)
    csv_train, _ = training_records(
        load_config(BASE_CONFIG, [f"data.train_manifest={tmp_path / 'videos.csv'}", *changes[1:]]).data
    )
    assert [r.first_path for r in csv_train] == [r.first_path for r in train]
    lines = open(path).readlines()
    open(path, "w").writelines(lines[:3] + [lines[3].replace(', "patient": "patient3"', "")] + lines[4:])
    with pytest.raises(ManifestError) as info:
        training_records(load_config(BASE_CONFIG, changes).data)
    assert str(info.value) == (
        f"{path}:4: no 'patient' (data.group_key: patient); give every video its patient, or set data.group_key: null"
    )


def test_k_fold_trains_and_scores_every_fold_keeping_groups_together(synthetic_root, tmp_path):
    rows = [(f"train_00{n:02d}.mp4", CLASSES[n % 3], f"patient{n % 6}") for n in range(12)]
    manifest(synthetic_root, tmp_path, rows)
    preset = tmp_path / "my-videos.yaml"
    preset.write_text(
        f"base: {BASE_CONFIG}\nexperiment: my_videos\ndata:\n  data_dir: {tmp_path}\n  train_manifest: videos.jsonl\n"
        "  group_key: patient\n  img_size: 32\n  num_frames: 8\n  frame_stride: 2\n  batch_size: 4\n"
        "  num_workers: 0\n  sample_timeout_s: null\nmodel:\n  width: 8\ntrain:\n  max_epochs: 1\n"
        "trainer:\n  device: cpu\n  plots: false\n"
    )
    out = tmp_path / "folds"
    command = ["-m", "engine.evaluation.k_fold", "--config", str(preset), "--folds", "2", "--out", str(out)]
    result = run_python(command)
    assert result.returncode == 0, result.stderr
    tested = []
    for fold in range(2):
        test = [json.loads(line) for line in open(out / f"fold{fold}" / "test.jsonl")]
        train = [json.loads(line) for line in open(out / f"fold{fold}" / "train.jsonl")]
        assert not {e["patient"] for e in test} & {e["patient"] for e in train}
        assert len(test) == 6 and len(train) == 6
        tested += [e["video"] for e in test]
    assert sorted(tested) == sorted(os.path.join(synthetic_root, "videos", v) for v, _, _ in rows)  # each once
    summary = json.load(open(out / "k_fold.json"))
    assert set(summary["folds"]) == {"0", "1"} and summary["group_key"] == "patient"
    for name, value in summary["mean"].items():
        folds = [summary["folds"][k][name] for k in "01"]
        assert 0 <= value <= 1 and value == pytest.approx(sum(folds) / 2), name
    table = open(out / "k_fold.md").read()
    assert "| mean | 2 folds |" in table and "| 0 | 6 / 6 |" in table
    again = run_python(command)
    assert again.returncode == 0 and again.stdout.count("trained already") == 2
    too_many = run_python([*command[:5], "7"])
    assert too_many.returncode == 2 and "--folds 7: only 6 groups to deal; give at most --folds 6" in too_many.stderr
