"""The long-range tasks: a label that depends on what happens across chunks (``bench/long_range.py`` trains on them).

The order of two events (``generate_long_range``, ``python -m datasets.synthetic --long-range``):

- ``videos/order_{split}_NNNN.mp4`` of ``--long-frames`` frames (default 1,024): grey, with fresh noise in every
  frame (no frame tells its time), and two brief, distinct events: A (the frame tinted red) and B (tinted green),
  ``--event-frames`` long, at least ``--min-gap`` frames apart. The label is their order: ``A_then_B`` or
  ``B_then_A``. ``order_train.jsonl``, ``order_val.jsonl``.
- Why no short view can solve it: the two event times are drawn once (first < second, the same distribution for
  both labels) and the label only decides which event comes first. A clip or chunk shorter than the gap holds at
  most one event, and sees the same A (or B) whatever the label, at no time it can read: any single chunk is at
  chance. Any order-blind pooling of chunks (mean, max, a sum of per-chunk scores) sees the same multiset of chunks
  (one with A, one with B, the rest empty) under both labels: at chance too, by construction. Only a model that
  knows which chunk came first can tell.

More families (``generate_task``, ``TASKS``), each at chance for order-blind pooling by the same construction:
three more about order and four about a relation between far events (``RELATION_EVENTS``):
whether two events are alike, which half holds more of one kind, whether the end matches the start (among two kinds
of event, or three). Each family
comes in four modalities (``MODALITIES``): its kinds of event told apart by colour, by motion, by texture at one
brightness, or by a count of pulses.
"""

from __future__ import annotations

from itertools import permutations

import numpy as np

from datasets.video_files import build_once, write_task_splits

ORDER_CLASSES = ("A_then_B", "B_then_A")
EVENT_COLOURS = {"A": (0, 0, 255), "B": (0, 255, 0), "C": (255, 0, 0)}  # BGR: A red, B green, C blue


def order_video(
    rng: np.random.Generator, label: str, frames: int, size: int, event_frames: int, min_gap: int
) -> tuple[list[np.ndarray], dict]:
    """The frames (BGR) of one long-range order video and where its events are: the two event times are drawn
    the same way for both labels (first < second); ``label`` only decides which event is first."""
    first = int(rng.integers(0, frames - 2 * event_frames - min_gap + 1))
    second = int(rng.integers(first + event_frames + min_gap, frames - event_frames + 1))
    names = ("A", "B") if label == "A_then_B" else ("B", "A")
    events = {names[0]: first, names[1]: second}
    return events_video(rng, list(events.items()), frames, size, event_frames), events


def event_times(rng: np.random.Generator, count: int, frames: int, event_frames: int, min_gap: int) -> list[int]:
    """``count`` event starts in ``[0, frames - event_frames]``, in order, at least ``min_gap`` frames between one
    event's end and the next one's start; every spacing that fits is equally likely, whatever the label."""
    slack = frames - count * event_frames - (count - 1) * min_gap
    if slack < 0:
        raise ValueError(f"{count} events of {event_frames} frames {min_gap} apart do not fit in {frames} frames")
    cuts = np.sort(rng.integers(0, slack + 1, size=count))
    return [int(cuts[i]) + i * (event_frames + min_gap) for i in range(count)]


# What tells the kinds of event (A, B, C) apart, beside the colour the families were first built with. In each
# other modality every kind has the same colour and the same mean brightness over its event, so a chunk's mean
# colour (or any thumbnail of it) does not tell them apart:
#   colour      the frame tinted red, green or blue
#   motion      a bright square crossing the frame: rightwards (A), leftwards (B) or downwards (C), at one speed;
#               A and B pass through the same positions, so no single frame tells them apart, only their order
#   texture     the frame replaced by stripes of the background's mean brightness: horizontal (A), vertical (B),
#               or a checkerboard (C)
#   repetition  the frame lit white in one pulse of 4 units (A), two of 2 (B) or four of 1 (C), a dark unit between
#               pulses: as many lit frames each, only their count differs (events of at least 7 units)
# A unit of the repetition is PULSE_UNIT frames, the frame stride the families train at: a clip at that stride holds
# one frame of every unit whatever its phase, so the pulses it sees are the pulses there are (with units of one
# frame, a clip at stride 4 saw one pulse of A, B or C alike at some phases).
MODALITIES = ("colour", "motion", "texture", "repetition")
REPETITION_PULSES = {"A": (4, 1), "B": (2, 2), "C": (1, 4)}  # (units a pulse, pulses)
PULSE_UNIT = 4
REPETITION_FRAMES = 7 * PULSE_UNIT  # C's four pulses and the three dark units between them


def event_frame(modality: str, name: str, step: int, event_frames: int, frame: np.ndarray) -> np.ndarray:
    """``frame`` (grey with noise) at ``step`` of ``event_frames`` of an event of kind ``name``."""
    if modality == "colour":
        return (0.4 * frame + 0.6 * np.array(EVENT_COLOURS[name])).astype(np.uint8)
    size = frame.shape[0]
    if modality == "motion":
        side = max(2, size // 4)
        travel = (size - side) * step // max(1, event_frames - 1)
        x, y = {"A": (travel, (size - side) // 2), "B": (size - side - travel, (size - side) // 2)}.get(
            name, ((size - side) // 2, travel)
        )
        out = frame.copy()
        out[y : y + side, x : x + side] = 230
        return out
    if modality == "texture":
        rows, cols = np.indices(frame.shape[:2])
        stripes = {"A": rows // 2 % 2, "B": cols // 2 % 2}.get(name, (rows // 2 + cols // 2) % 2)
        pattern = (128 + 60 * (2 * stripes - 1)).astype(np.int16)[..., None]
        return np.clip(pattern + (frame.astype(np.int16) - 128) // 3, 0, 255).astype(np.uint8)
    if modality == "repetition":
        width, pulses = REPETITION_PULSES[name]
        pattern_frames = (pulses * width + pulses - 1) * PULSE_UNIT  # the pulses and the dark units between them
        offset = step - (event_frames - pattern_frames) // 2
        lit = 0 <= offset < pattern_frames and offset // PULSE_UNIT % (width + 1) < width
        return np.full_like(frame, 230) if lit else frame
    raise ValueError(f"unknown modality {modality!r}; expected one of {', '.join(MODALITIES)}")


def events_video(
    rng: np.random.Generator,
    events: list[tuple[str, int]],
    frames: int,
    size: int,
    event_frames: int,
    modality: str = "colour",
) -> list[np.ndarray]:
    """Grey frames with fresh noise (no frame tells its time) and each (kind, start) event shown over
    ``event_frames`` frames as ``modality`` shows that kind (MODALITIES)."""
    video = []
    for t in range(frames):
        frame = rng.integers(90, 166, size=(size, size, 3), dtype=np.uint8)
        for name, start in events:
            if start <= t < start + event_frames:
                frame = event_frame(modality, name, t - start, event_frames, frame)
        video.append(frame)
    return video


# Long-range task families beside the order of two events. Each draws its event times without looking at the label
# and gives every label the same multiset of events, so a bag of chunks (mean, max or any order-blind pooling of
# per-chunk scores) sees the same thing under every label: at chance by construction; and a single chunk, which
# holds one event at a time it cannot tell, sees each colour equally often under every label. The label is in the
# arrangement of the events.
# Order:
#   middle       three events, one of each colour A, B, C, in a random order: the colour of the middle one
#   last         four events, two A and two B, in a random order: the colour of the last one
#   distractors  A and B once each among 2 to 4 C events, all in a random order: which of A and B came first
# Relations between far events (each event's colour only means something beside another's):
#   twice        two attempts of two events each (A, A, B, B in all): was the second attempt like the first
#                (the 1st event's colour equals the 3rd's, so the 2nd's the 4th's)
#   more         six events, three A and three B: which colour the first three events hold more of
#   match        four events, A, A, B, B: does the last event's colour match the first's
#   match3       match with three kinds: six events, A, A, B, B, C, C
# Each has its own shape (video length, event length, gap), so no single shape is tuned.
TASKS = {
    "middle": {"classes": ("middle_A", "middle_B", "middle_C"), "frames": 384, "event_frames": 8, "min_gap": 96},
    "last": {"classes": ("last_A", "last_B"), "frames": 640, "event_frames": 12, "min_gap": 64},
    "distractors": {"classes": ("A_first", "B_first"), "frames": 1024, "event_frames": 6, "min_gap": 48},
    "twice": {"classes": ("same_attempts", "other_attempts"), "frames": 512, "event_frames": 8, "min_gap": 64},
    "more": {"classes": ("more_A_first", "more_B_first"), "frames": 768, "event_frames": 6, "min_gap": 48},
    "match": {"classes": ("ends_match", "ends_differ"), "frames": 640, "event_frames": 10, "min_gap": 80},
    "match3": {"classes": ("ends_match", "ends_differ"), "frames": 768, "event_frames": 10, "min_gap": 80},
}


def mirrored_classes(task: str, modality: str) -> list[list[str]]:
    """The pairs of ``task``'s classes that a horizontal flip swaps (``data.flip_label_pairs``). In the motion
    modality a mirror turns A's rightward square into B's leftward one (C's downward square, centred, stays C), so a
    label that names A or B names the other once mirrored; a relation of A and B (match, twice) stays as it is, and
    nothing swaps in the other modalities. Without these pairs a flip trains on clips whose label says the opposite
    of what they show: at chance by construction."""
    if modality != "motion":
        return []
    swap = {"A": "B", "B": "A"}
    pairs = []
    for name in TASKS[task]["classes"]:
        mirror = "_".join(swap.get(part, part) for part in name.split("_"))
        if mirror != name and [mirror, name] not in pairs:
            pairs.append([name, mirror])
    return pairs


def arrangements(colours: str) -> list[str]:
    """Every distinct order of the multiset ``colours`` ('AABB' -> 'AABB', 'ABAB', ...), sorted."""
    return sorted({"".join(p) for p in permutations(colours)})


def relation_holds(task: str, order: str) -> bool:
    """Whether the events ``order`` (their colours in time order) have ``task``'s relation: the first class."""
    if task == "twice":
        return order[0] == order[2]
    if task == "more":
        return order[:3].count("A") > order[:3].count("B")
    return order[0] == order[-1]  # match, match3


RELATION_EVENTS = {"twice": "AABB", "more": "AAABBB", "match": "AABB", "match3": "AABBCC"}


def task_events(rng: np.random.Generator, task: str, label: str) -> list[str]:
    """The colours of a ``task`` video's events in time order, for ``label``."""
    if task in RELATION_EVENTS:
        holds = label == TASKS[task]["classes"][0]
        fitting = [o for o in arrangements(RELATION_EVENTS[task]) if relation_holds(task, o) == holds]
        return list(fitting[int(rng.integers(len(fitting)))])
    if task == "middle":
        others = [c for c in "ABC" if c != label[-1]]
        rng.shuffle(others)
        return [others[0], label[-1], others[1]]
    if task == "last":
        first = ["A", "A", "B", "B"]
        first.remove(label[-1])
        rng.shuffle(first)
        return first + [label[-1]]
    distractors = ["C"] * int(rng.integers(2, 5))
    order = ["A", "B"] if label == "A_first" else ["B", "A"]
    slots = sorted(rng.choice(len(distractors) + 2, size=2, replace=False))
    colours = distractors[:]
    for slot, name in zip(slots, order):
        colours.insert(slot, name)
    return colours


def generate_task(
    out: str,
    task: str,
    seed: int = 0,
    size: int = 32,
    fps: float = 25.0,
    num_train: int = 96,
    num_val: int = 48,
    quiet: bool = False,
    modality: str = "colour",
    **shape,
) -> str:
    """Write a long-range task family (``TASKS``) to ``out``: ``videos/``, ``{task}_train.jsonl``,
    ``{task}_val.jsonl`` (each line with its events), ``classes.txt``; skipped when complete with the same
    arguments. ``modality``: what tells its kinds of event apart (MODALITIES); ``shape``: frames, event_frames or
    min_gap other than the family's (small tests)."""
    spec = {**TASKS[task], **shape}
    if modality == "repetition":
        spec["event_frames"] = max(spec["event_frames"], REPETITION_FRAMES)
    args = dict(
        kind=f"task_{task}" if modality == "colour" else f"task_{task}_{modality}",
        seed=seed,
        size=size,
        fps=fps,
        num_train=num_train,
        num_val=num_val,
        **{**spec, "classes": list(spec["classes"])},
    )  # as the marker's JSON gives it back

    def sample(rng, split: str, i: int) -> tuple:
        label = spec["classes"][i % len(spec["classes"])]
        colours = task_events(rng, task, label)
        times = event_times(rng, len(colours), spec["frames"], spec["event_frames"], spec["min_gap"])
        events = list(zip(colours, times))
        video = events_video(rng, events, spec["frames"], size, spec["event_frames"], modality)
        return video, {"label": label, "events": events}

    def write(root: str) -> None:
        write_task_splits(
            root,
            task,
            spec["classes"],
            {"train": num_train, "val": num_val},
            sample,
            size,
            fps,
            seed,
            None if quiet else lambda split, count: f"  {task} {split}: {count} videos of {spec['frames']} frames",
        )

    return build_once(out, args, write, quiet)


def generate_long_range(
    out: str,
    seed: int = 0,
    size: int = 32,
    fps: float = 25.0,
    num_train: int = 96,
    num_val: int = 48,
    frames: int = 1024,
    event_frames: int = 12,
    min_gap: int = 320,
    quiet: bool = False,
) -> str:
    """Write the long-range order task (module docstring) to ``out``; skipped when a complete one with the same
    arguments is there."""
    if frames < 2 * event_frames + min_gap:
        raise SystemExit(
            f"error: --long-frames {frames} cannot hold two events of {event_frames} frames "
            f"{min_gap} apart; give at least {2 * event_frames + min_gap}"
        )
    args = dict(
        kind="long_range",
        seed=seed,
        size=size,
        fps=fps,
        num_train=num_train,
        num_val=num_val,
        frames=frames,
        event_frames=event_frames,
        min_gap=min_gap,
    )

    def sample(rng, split: str, i: int) -> tuple:
        label = ORDER_CLASSES[i % 2]
        video, events = order_video(rng, label, frames, size, event_frames, min_gap)
        return video, {"label": label, "events": events}

    def write(root: str) -> None:
        write_task_splits(
            root,
            "order",
            ORDER_CLASSES,
            {"train": num_train, "val": num_val},
            sample,
            size,
            fps,
            seed,
            None
            if quiet
            else lambda split, count: (
                f"  {split}: {count} videos of {frames} frames, "
                f"events of {event_frames} frames at least "
                f"{min_gap} apart"
            ),
        )

    return build_once(out, args, write, quiet)
