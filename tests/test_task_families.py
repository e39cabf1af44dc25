"""The long-range task families (datasets/long_range_tasks.py): long-range by construction (every label the same
events, the label in their arrangement), in every modality (the kinds of event told apart by colour, motion, texture
at one brightness or a count of pulses), each rendered as it says."""

import json
import os

import cv2
import numpy as np
import pytest

from datasets.long_range_tasks import (
    MODALITIES,
    PULSE_UNIT,
    RELATION_EVENTS,
    REPETITION_FRAMES,
    TASKS,
    event_frame,
    generate_task,
    mirrored_classes,
    relation_holds,
    task_events,
)


@pytest.mark.parametrize("task", ["middle", "last", "distractors", "twice", "more", "match", "match3"])
def test_each_task_family_gives_every_label_the_same_events_and_puts_the_label_in_their_order(tmp_path, task):
    """What makes a family long-range by construction: the events' colours form the same multiset under every
    label (an order-blind pooling of chunks sees the same bag), their times do not depend on the label, and the
    label follows from their order alone: for the relation families, from a relation between events, each of
    whose colours is each of the family's kinds equally often under every label (a chunk seeing one event learns
    nothing)."""
    args = dict(size=8, num_train=24, num_val=6, frames=160, event_frames=4, min_gap=8, quiet=True)
    data = generate_task(str(tmp_path / task), task, **args)
    assert generate_task(str(tmp_path / task), task, **args) == data  # complete with these arguments: kept
    lines = [json.loads(line) for line in open(os.path.join(data, f"{task}_train.jsonl"))]
    assert sorted({line["label"] for line in lines}) == sorted(TASKS[task]["classes"])
    bags = {}
    for line in lines:
        colours = [colour for colour, _ in line["events"]]
        times = [start for _, start in line["events"]]
        assert times == sorted(times) and all(b - a >= 4 + 8 for a, b in zip(times, times[1:]))
        if task == "middle":
            assert line["label"] == f"middle_{colours[1]}"
        elif task == "last":
            assert line["label"] == f"last_{colours[-1]}"
        elif task == "twice":  # the second attempt (events 3, 4) like the first (events 1, 2)
            assert (line["label"] == "same_attempts") == (colours[:2] == colours[2:])
        elif task == "more":
            assert line["label"] == ("more_A_first" if colours[:3].count("A") >= 2 else "more_B_first")
        elif task in ("match", "match3"):
            assert (line["label"] == "ends_match") == (colours[0] == colours[-1])
        else:
            assert line["label"] == ("A_first" if colours.index("A") < colours.index("B") else "B_first")
        bag = tuple(sorted(colours)) if task != "distractors" else tuple(sorted(c for c in colours if c != "C"))
        bags.setdefault(line["label"], set()).add(bag)
    assert len({frozenset(b) for b in bags.values()}) == 1  # every label: the same bags of colours
    if task in RELATION_EVENTS:  # the first event is of each kind as often under each label (by symmetry)
        full = [json.loads(line) for line in open(os.path.join(data, f"{task}_val.jsonl"))] + lines
        kinds = sorted(set(RELATION_EVENTS[task]))
        assert {"".join(sorted(c for c, _ in line["events"])) for line in full} == {RELATION_EVENTS[task]}
        for label in TASKS[task]["classes"]:
            firsts = [line["events"][0][0] for line in full if line["label"] == label]
            for kind in kinds:
                assert 0.5 / len(kinds) <= firsts.count(kind) / len(firsts) <= 1.5 / len(kinds), (label, firsts)
    frames = decode_frames(os.path.join(data, lines[0]["video"]))
    colour, start = lines[0]["events"][0]
    channel = {"A": 2, "B": 1, "C": 0}[colour]  # BGR
    assert frames[start + 1][..., channel].mean() > 150 and frames[start - 1][..., channel].mean() < 150


def decode_frames(path: str) -> list:
    capture, frames = cv2.VideoCapture(path), []
    while True:
        ok, frame = capture.read()
        if not ok:
            return frames
        frames.append(frame)


# events as long as the repetition's (in colour too, so that both draw the same times)
SHAPE = dict(size=32, num_train=16, num_val=4, frames=160, event_frames=REPETITION_FRAMES, min_gap=8, quiet=True)


@pytest.mark.parametrize("modality", [m for m in MODALITIES if m != "colour"])
def test_each_modality_keeps_the_familys_events_and_tells_the_kinds_apart_only_as_it_says(tmp_path, modality):
    """A family in another modality draws the same labels, events and times as in colour (so every guarantee of
    the test above holds), and in the decoded video its kinds of event have the same mean brightness, told apart
    only by what the modality says: the direction a square moves, the direction of stripes, the count of pulses."""
    colour = generate_task(str(tmp_path / "colour"), "match", **SHAPE)
    other = generate_task(str(tmp_path / modality), "match", modality=modality, **SHAPE)
    lines = [json.loads(line) for line in open(os.path.join(other, "match_train.jsonl"))]
    same = [json.loads(line) for line in open(os.path.join(colour, "match_train.jsonl"))]
    assert [(x["label"], x["events"]) for x in lines] == [(x["label"], x["events"]) for x in same]
    seen = {"A": [], "B": []}
    for line in lines[:6]:
        frames = decode_frames(os.path.join(other, line["video"]))
        for kind, start in line["events"]:
            event = frames[start : start + REPETITION_FRAMES]
            seen[kind].append(np.stack(event).astype(np.float32).mean(axis=3))  # [frames, H, W]
    brightness = {kind: np.mean([event.mean() for event in events]) for kind, events in seen.items()}
    assert abs(brightness["A"] - brightness["B"]) < 3, brightness  # the same light: no colour or brightness cue
    for kind, events in seen.items():
        for event in events:
            if modality == "motion":  # the bright square's centre: rightwards for A, leftwards for B
                columns = [np.average(np.arange(32), weights=(f > 200).sum(axis=0) + 1e-6) for f in event]
                assert (columns[-1] > columns[0] + 10) == (kind == "A"), (kind, columns)
            elif modality == "texture":  # horizontal stripes change from row to row, vertical ones along a row
                rows, cols = np.abs(np.diff(event, axis=1)).mean(), np.abs(np.diff(event, axis=2)).mean()
                assert (rows > 2 * cols) == (kind == "A") and (cols > 2 * rows) == (kind == "B"), (kind, rows, cols)
            else:  # the lit frames: one pulse for A, two for B, 16 frames lit either way, at any phase of stride 4
                lit = [bool(f.mean() > 200) for f in event]
                assert sum(lit) == 4 * PULSE_UNIT, (kind, lit)
                for phase in range(PULSE_UNIT):
                    seen_lit = lit[phase::PULSE_UNIT]
                    pulses = sum(1 for i, x in enumerate(seen_lit) if x and (i == 0 or not seen_lit[i - 1]))
                    assert pulses == {"A": 1, "B": 2}[kind], (kind, phase, seen_lit)


def test_the_synthetic_command_writes_a_family_in_a_modality(tmp_path):
    """`python -m datasets.synthetic --family NAME --modality M` (the data of configs/long-range-relations.yaml):
    the family's manifests with as many videos as asked, every label of the family among them, the modality's
    videos at the family's length."""
    from datasets.synthetic import main

    out = tmp_path / "task_match_motion"
    argv = ["--family", "match", "--modality", "motion", "--num-train", "4", "--num-val", "2", "--size", "16"]
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    train = [json.loads(line) for line in open(out / "match_train.jsonl")]
    val = [json.loads(line) for line in open(out / "match_val.jsonl")]
    assert len(train) == 4 and len(val) == 2
    assert {line["label"] for line in train} == set(TASKS["match"]["classes"])
    capture = cv2.VideoCapture(str(out / train[0]["video"]))
    assert int(capture.get(cv2.CAP_PROP_FRAME_COUNT)) == TASKS["match"]["frames"]
    assert int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)) == 16
    capture.release()


def label_of(task: str, kinds: list[str]) -> str:
    """The class of a ``task`` video whose events are ``kinds`` in time order, as the module docstring states it."""
    classes = TASKS[task]["classes"]
    if task in RELATION_EVENTS:
        return classes[0] if relation_holds(task, "".join(kinds)) else classes[1]
    if task == "middle":
        return f"middle_{kinds[1]}"
    if task == "last":
        return f"last_{kinds[-1]}"
    return "A_first" if kinds.index("A") < kinds.index("B") else "B_first"


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_mirrored_motion_video_is_one_of_the_class_its_flip_pairs_name(task):
    """A horizontal flip (data.augment with data.flip) of a video in motion turns each rightward square (A) into a
    leftward one (B) pixel for pixel, and back, and leaves the downward one (C); the class of the mirrored events is
    the one mirrored_classes pairs with the video's class, so a training run that flips with those pairs keeps
    every label true. In the other modalities a flip swaps no kind and no class."""
    rng = np.random.default_rng(0)
    noise = rng.integers(90, 166, size=(32, 32, 3), dtype=np.uint8)
    swap = {"A": "B", "B": "A", "C": "C"}
    for kind in "ABC":
        for step in range(12):
            shown = event_frame("motion", kind, step, 12, noise)
            mirrored = event_frame("motion", swap[kind], step, 12, noise[:, ::-1])
            np.testing.assert_array_equal(shown[:, ::-1], mirrored)
    pairs = {name: mirror for pair in mirrored_classes(task, "motion") for name, mirror in (pair, pair[::-1])}
    for label in TASKS[task]["classes"]:
        for _ in range(8):
            kinds = task_events(rng, task, label)
            assert label_of(task, kinds) == label
            assert label_of(task, [swap[k] for k in kinds]) == pairs.get(label, label), (task, label, kinds)
    for modality in MODALITIES:
        if modality != "motion":
            assert mirrored_classes(task, modality) == []
