"""A temporal action segmentation task whose labels need context no single chunk holds (``bench/timelines.py``,
``python -m datasets.synthetic --segmentation``).

Each video is a sequence of segments that cover it, each 40 to 120 frames of one look: grey frames with fresh noise
(no frame tells its time), tinted red, green or blue; no look follows itself. The first segment is labelled by its
look (``red``); every later one by its look and the look before it (``red_after_green``, ``red_after_blue``): the
same motion labelled differently depending on the segment before it.

Why per-chunk classification cannot solve it: a chunk inside a segment shows its look and nothing of the segment
before, and both looks that may precede are equally likely; so any model of one chunk tells at best which look,
and is at chance between the two labels every later segment may have (and the first segment's label, rarer, it
can only guess). A model over the video's chunks (the temporal head: transformer or tcn) sees the segment before.
"""

from __future__ import annotations

import numpy as np

from datasets.long_range_tasks import EVENT_COLOURS
from datasets.mstcn import write_index, write_video
from datasets.video_files import build_once, write_task_splits

SEGMENT_CLASSES = (
    "red",
    "green",
    "blue",
    "red_after_green",
    "red_after_blue",
    "green_after_red",
    "green_after_blue",
    "blue_after_red",
    "blue_after_green",
)
BACKGROUND = "background"  # MS-TCN's background label (datasets.mstcn)
LOOKS = {"red": "A", "green": "B", "blue": "C"}  # the look's tint (long_range_tasks.EVENT_COLOURS: A red ...)


def segment_plan(
    rng: np.random.Generator, frames: int, shortest: int, longest: int, background: float = 0.0
) -> list[dict]:
    """Segments [{"start", "end", "label", "look"}] covering ``frames``; with ``background`` > 0, that share of
    the segments after the first is ``background`` (look and label), which the next look's label sees past."""
    segments, start, previous, last = [], 0, None, None
    while start < frames:
        length = int(rng.integers(shortest, longest + 1))
        end = frames if frames - (start + length) < shortest else start + length  # no stub at the end
        if background and last not in (None, BACKGROUND) and rng.random() < background:
            look = label = BACKGROUND
        else:
            look = str(rng.choice([look for look in LOOKS if look != previous]))  # two segments, not one
            label = look if previous is None else f"{look}_after_{previous}"
            previous = look
        segments.append({"start": start, "end": end, "label": label, "look": look})
        start, last = end, look
    return segments


def segment_video(
    rng: np.random.Generator, frames: int, size: int, shortest: int, longest: int
) -> tuple[list[np.ndarray], list[dict]]:
    """The frames (BGR) of one video and its segments [{"start", "end", "label"}] covering every frame."""
    segments = segment_plan(rng, frames, shortest, longest)
    video = []
    for t in range(frames):
        look = next(s["look"] for s in segments if s["start"] <= t < s["end"])
        frame = rng.integers(90, 166, size=(size, size, 3), dtype=np.uint8)
        video.append((0.6 * frame + 0.4 * np.array(EVENT_COLOURS[LOOKS[look]])).astype(np.uint8))
    return video, [{k: s[k] for k in ("start", "end", "label")} for s in segments]


def generate_segmentation(
    out: str,
    seed: int = 0,
    size: int = 32,
    fps: float = 25.0,
    num_train: int = 48,
    num_val: int = 16,
    frames: int = 600,
    shortest: int = 40,
    longest: int = 120,
    quiet: bool = False,
) -> str:
    """Write the task to ``out``: ``videos/``, ``seg_train.jsonl``, ``seg_val.jsonl`` (each line with its
    segments), ``classes.txt``; skipped when complete with the same arguments."""
    args = dict(
        kind="segmentation",
        seed=seed,
        size=size,
        fps=fps,
        num_train=num_train,
        num_val=num_val,
        frames=frames,
        shortest=shortest,
        longest=longest,
    )

    def sample(rng, split: str, i: int) -> tuple:
        video, segments = segment_video(rng, frames, size, shortest, longest)
        return video, {"segments": segments}

    def write(root: str) -> None:
        write_task_splits(
            root,
            "seg",
            SEGMENT_CLASSES,
            {"train": num_train, "val": num_val},
            sample,
            size,
            fps,
            seed,
            None if quiet else lambda split, count: f"  segmentation {split}: {count} videos of {frames} frames",
        )

    return build_once(out, args, write, quiet)


# How MS-TCN's datasets label what is not an action (their mapping.txt and groundTruth files): the background's
# label (None: there is none), the labels of every video's first and last frames (None: actions from the first
# frame), and whether those labels come first in mapping.txt or after the actions. "generic" is this project's own.
LABEL_CONVENTIONS = {
    "generic": {"background": BACKGROUND, "edges": None, "first": True},
    "gtea": {"background": BACKGROUND, "edges": None, "first": False},  # background is GTEA's last class
    "breakfast": {"background": "SIL", "edges": ("SIL", "SIL"), "first": True},  # 0 SIL; SIL at both ends
    "50salads": {"background": None, "edges": ("action_start", "action_end"), "first": False},
}
EDGE_FRAMES = (20, 40)  # the shortest and longest first and last segments of a convention with edges


def segment_features(
    rng: np.random.Generator,
    frames: int,
    prototypes: dict,
    shortest: int,
    longest: int,
    convention: dict | None = None,
    noise: float = 1.0,
):
    """The task as features (``generate_features``): each frame the feature vector of its look, ``prototypes``
    [look] [D], under Gaussian noise of std ``noise`` (a frame tells its look, never the look before); a quarter of the
    segments after the first are background where ``convention`` (LABEL_CONVENTIONS, default generic) has one,
    and its edges (if any) open and close the video, looking like background. -> (features [T, D], labels [T])."""
    convention = convention or LABEL_CONVENTIONS["generic"]
    edges = convention["edges"]
    head, tail = (int(rng.integers(EDGE_FRAMES[0], EDGE_FRAMES[1] + 1)) for _ in range(2)) if edges else (0, 0)
    inner = segment_plan(rng, frames - head - tail, shortest, longest, 0.25 if convention["background"] else 0.0)
    segments = [  # shifted past the opening edge, the background under the convention's name
        {
            **s,
            "start": s["start"] + head,
            "end": s["end"] + head,
            "label": convention["background"] if s["label"] == BACKGROUND else s["label"],
        }
        for s in inner
    ]
    if edges:
        segments = [
            {"start": 0, "end": head, "look": BACKGROUND, "label": edges[0]},
            *segments,
            {"start": frames - tail, "end": frames, "look": BACKGROUND, "label": edges[1]},
        ]
    dim = len(next(iter(prototypes.values())))
    features = rng.normal(0.0, noise, size=(frames, dim)).astype(np.float32)
    labels = []
    for segment in segments:
        features[segment["start"] : segment["end"]] += prototypes[segment["look"]]
        labels += [segment["label"]] * (segment["end"] - segment["start"])
    return features, labels


def convention_classes(convention: dict) -> list[str]:
    """mapping.txt's classes under ``convention``: the actions, with its background and edge labels first or
    last."""
    extra = [label for label in (convention["background"], *(convention["edges"] or ())) if label]
    extra = list(dict.fromkeys(extra))  # SIL once
    return [*extra, *SEGMENT_CLASSES] if convention["first"] else [*SEGMENT_CLASSES, *extra]


def generate_features(
    out: str,
    seed: int = 0,
    videos: int = 12,
    frames: int = 600,
    dim: int = 32,
    splits: int = 2,
    quiet=False,
    labels: str = "generic",
    noise: float = 1.0,
    separation: float = 1.5,
) -> str:
    """The task in MS-TCN's layout (datasets.mstcn) at ``out``: ``videos`` videos of ``frames`` feature frames,
    ``dim`` features each, in ``splits`` cross-validation splits (video i is in split i % splits + 1's test set,
    in every other split's training set), labelled as ``labels`` (a LABEL_CONVENTIONS name: generic has
    background as class 0). ``noise``: the standard deviation of each frame's Gaussian noise, beside ``separation``,
    the scale of the looks' feature vectors (harder as noise grows). The same seed writes the same files."""
    convention = LABEL_CONVENTIONS[labels]
    rng = np.random.default_rng(seed)
    prototypes = {look: rng.normal(0.0, 1.0, size=dim).astype(np.float32) * separation for look in (*LOOKS, BACKGROUND)}
    names = [f"video_{i:03d}" for i in range(videos)]
    for name in names:
        features, video_labels = segment_features(rng, frames, prototypes, 40, 120, convention, noise)
        write_video(out, name, features, video_labels)
    bundles = {}
    for split in range(1, splits + 1):
        test = [n for i, n in enumerate(names) if i % splits == split - 1]
        bundles[f"train.split{split}"] = [n for n in names if n not in test]
        bundles[f"test.split{split}"] = test
    write_index(out, convention_classes(convention), bundles)
    if not quiet:
        print(
            f"wrote {out}: {videos} videos of {frames} frames x {dim} features in MS-TCN's layout, {splits} splits, "
            f"{labels} labels"
        )
    return out
