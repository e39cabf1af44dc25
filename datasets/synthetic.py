"""Deterministic synthetic video dataset: the demo's and the tests' data.

    python -m datasets.synthetic --out data/synthetic [--seed 0] [--size 64] ...

A shape (square, disc or triangle, random colour, size and place) moves; the label is the motion:
left, right, up, down (wrapping around the frame edges), grow or shrink. Any single frame is a shape
somewhere, so only motion over time tells the classes apart.

Written (paths relative to --out):
- ``videos/{split}_NNNN.mp4`` short labelled clips; ``train.jsonl``, ``val.jsonl``, ``test.jsonl``;
- ``keypoints/{stem}/NNNNNN_{stem}.npz`` per-frame keypoints of the short clips (key ``keypoints``,
  [J=5, 3]: the shape's bounding-box corners and centre as x/width, y/height, confidence);
- ``videos/long_NN.mp4`` long videos whose label changes along a timeline of segments (each segment a
  new scene), ``keypoints/long_NN.npy`` ([T, 5, 3], one array), and ``long.jsonl`` with ``segments``;
- ``videos/mv_{split}_NNNN_{front,left,right}.mp4``: the same scene seen by three cameras rendered
  differently (colours, noise, zoom); ``multiview_train.jsonl``, ``multiview_val.jsonl``;
- ``classes.txt``.

With ``--long-range`` it writes instead the long-range order task, with ``--family NAME`` one of the long-range task
families (order, relation; ``--modality``: what tells its events apart), both in ``datasets/long_range_tasks.py``.

The output directory is built under a temporary name and renamed when complete, so an interrupted run
never leaves a half-written dataset; a complete one with the same arguments is left as it is.
"""

from __future__ import annotations

import argparse
import os

import cv2
import numpy as np

from core.cli import exit_on_usage_error
from datasets.long_range_tasks import MODALITIES, TASKS, generate_long_range, generate_task
from datasets.segmentation_task import LABEL_CONVENTIONS, generate_features, generate_segmentation
from datasets.video_files import build_once, write_jsonl, write_video

CLASSES = ("down", "grow", "left", "right", "shrink", "up")
SHAPES = ("square", "disc", "triangle")
VIEWS = ("front", "left", "right")
NUM_JOINTS = 5


class Scene:
    """One moving shape; ``position(t)`` and ``half_size(t)`` describe frame t of the scene."""

    def __init__(self, rng: np.random.Generator, label: str, length: int, size: int):
        self.label, self.size = label, size
        self.shape = SHAPES[rng.integers(len(SHAPES))]
        self.colour = tuple(int(c) for c in rng.integers(90, 256, size=3))
        self.background = int(rng.integers(0, 60))
        self.start = rng.uniform(0, size, size=2)  # x, y
        self.speed = rng.uniform(0.06, 0.12) * size / 4  # pixels per frame
        small, large = 0.07 * size, 0.22 * size
        self.sizes = (small, large) if label == "grow" else (large, small)
        if label not in ("grow", "shrink"):
            base = rng.uniform(small, large)
            self.sizes = (base, base)
        self.length = max(length, 2)

    def position(self, t: int) -> np.ndarray:
        step = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}.get(self.label, (0, 0))
        return (self.start + self.speed * t * np.array(step)) % self.size

    def half_size(self, t: int) -> float:
        a, b = self.sizes
        return a + (b - a) * t / (self.length - 1)


def draw(scene: Scene, t: int, view: str = "front") -> tuple[np.ndarray, np.ndarray]:
    """Frame t (BGR uint8) and its keypoints [J, 3] for one camera view."""
    size = scene.size
    frame = np.full((size, size, 3), scene.background, np.uint8)
    centre, half = scene.position(t), scene.half_size(t)
    colour = scene.colour
    if view == "left":
        colour = colour[::-1]
        frame[:] = (scene.background + 40, scene.background, scene.background)
    # the motion wraps around the edges: draw the shape's copies so it crosses an edge smoothly
    for dx in (-size, 0, size):
        for dy in (-size, 0, size):
            cx, cy = centre[0] + dx, centre[1] + dy
            if -half - 1 <= cx <= size + half + 1 and -half - 1 <= cy <= size + half + 1:
                _draw_shape(frame, scene.shape, cx, cy, half, colour)
    if view == "left":  # a noisier camera
        noise = np.random.default_rng(t).integers(-12, 13, size=frame.shape)
        frame = np.clip(frame.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    elif view == "right":  # a wider camera: the scene appears smaller, framed by a grey border
        inner = cv2.resize(frame, (size * 3 // 4, size * 3 // 4), interpolation=cv2.INTER_AREA)
        frame = np.full_like(frame, 128)
        offset = size // 8
        frame[offset : offset + inner.shape[0], offset : offset + inner.shape[1]] = inner
    corners = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1], [0, 0]], np.float32) * half + centre
    keypoints = np.concatenate([corners / size, np.ones((NUM_JOINTS, 1), np.float32)], axis=1)
    return frame, keypoints.astype(np.float32)


def _draw_shape(frame, shape, cx, cy, half, colour):
    shift = 4  # sub-pixel positions (cv2 fixed point), so slow motion is not quantised to whole pixels
    scale = 1 << shift
    if shape == "square":
        pts = np.array([[cx - half, cy - half], [cx + half, cy - half], [cx + half, cy + half], [cx - half, cy + half]])
        cv2.fillPoly(frame, [np.round(pts * scale).astype(np.int32)], colour, cv2.LINE_AA, shift)
    elif shape == "disc":
        cv2.circle(frame, (round(cx * scale), round(cy * scale)), round(half * scale), colour, -1, cv2.LINE_AA, shift)
    else:
        pts = np.array([[cx, cy - half], [cx + half, cy + half], [cx - half, cy + half]])
        cv2.fillPoly(frame, [np.round(pts * scale).astype(np.int32)], colour, cv2.LINE_AA, shift)


def generate(
    out: str,
    seed: int = 0,
    size: int = 64,
    fps: float = 25.0,
    num_train: int = 192,
    num_val: int = 48,
    num_test: int = 48,
    short_frames: int = 40,
    num_long: int = 2,
    long_frames: int = 3000,
    num_multiview: int = 48,
    quiet: bool = False,
) -> str:
    """Write the dataset to ``out`` (skipped when a complete one with the same arguments is there)."""
    args = dict(
        seed=seed,
        size=size,
        fps=fps,
        num_train=num_train,
        num_val=num_val,
        num_test=num_test,
        short_frames=short_frames,
        num_long=num_long,
        long_frames=long_frames,
        num_multiview=num_multiview,
    )

    def write(root: str) -> None:
        _generate_into(root, np.random.default_rng(seed), quiet=quiet, **{k: v for k, v in args.items() if k != "seed"})

    return build_once(out, args, write, quiet)


def _generate_into(
    root: str,
    rng: np.random.Generator,
    size: int,
    fps: float,
    num_train: int,
    num_val: int,
    num_test: int,
    short_frames: int,
    num_long: int,
    long_frames: int,
    num_multiview: int,
    quiet: bool,
) -> None:
    os.makedirs(os.path.join(root, "videos"))
    os.makedirs(os.path.join(root, "keypoints"))
    with open(os.path.join(root, "classes.txt"), "w") as f:
        f.write("\n".join(CLASSES) + "\n")

    for split, count in (("train", num_train), ("val", num_val), ("test", num_test)):
        lines = []
        for i in range(count):
            label = CLASSES[i % len(CLASSES)]  # balanced classes
            stem = f"{split}_{i:04d}"
            scene = Scene(rng, label, short_frames, size)
            kpt_dir = os.path.join(root, "keypoints", stem)
            os.makedirs(kpt_dir)
            frames = []
            for t in range(short_frames):
                frame, keypoints = draw(scene, t)
                frames.append(frame)
                np.savez(os.path.join(kpt_dir, f"{t:06d}_{stem}.npz"), keypoints=keypoints)
            write_video(os.path.join(root, "videos", stem + ".mp4"), frames, size, fps)
            lines.append({"video": f"videos/{stem}.mp4", "label": label, "keypoints": f"keypoints/{stem}"})
        write_jsonl(os.path.join(root, f"{split}.jsonl"), lines)
        if not quiet:
            print(f"  {split}: {count} videos of {short_frames} frames")

    lines = []
    for i in range(num_long):
        stem = f"long_{i:02d}"
        segments, start = [], 0
        while start < long_frames:
            end = min(long_frames, start + int(rng.integers(120, 400)))
            if long_frames - end < 60:  # no sliver of a segment at the end
                end = long_frames
            segments.append({"start": start, "end": end, "label": CLASSES[rng.integers(len(CLASSES))]})
            start = end
        keypoints = np.zeros((long_frames, NUM_JOINTS, 3), np.float32)

        def frames(segments=segments, keypoints=keypoints):  # consumed in this iteration, by write_video
            for seg in segments:
                scene = Scene(rng, seg["label"], seg["end"] - seg["start"], size)
                for t in range(seg["end"] - seg["start"]):
                    frame, keypoints[seg["start"] + t] = draw(scene, t)
                    yield frame

        write_video(os.path.join(root, "videos", stem + ".mp4"), frames(), size, fps)
        np.save(os.path.join(root, "keypoints", stem + ".npy"), keypoints)
        lines.append({"video": f"videos/{stem}.mp4", "segments": segments, "keypoints": f"keypoints/{stem}.npy"})
    write_jsonl(os.path.join(root, "long.jsonl"), lines)
    if not quiet:
        print(f"  long: {num_long} videos of {long_frames} frames with a timeline of segments")

    for split, count in (("train", num_multiview), ("val", num_multiview // 2)):
        lines = []
        for i in range(count):
            label = CLASSES[i % len(CLASSES)]
            scene = Scene(rng, label, short_frames, size)
            views = {}
            for view in VIEWS:
                path = f"videos/mv_{split}_{i:04d}_{view}.mp4"
                write_video(os.path.join(root, path), (draw(scene, t, view)[0] for t in range(short_frames)), size, fps)
                views[view] = path
            lines.append({"views": views, "label": label})
        write_jsonl(os.path.join(root, f"multiview_{split}.jsonl"), lines)
    if not quiet:
        print(f"  multi-view: {num_multiview} + {num_multiview // 2} scenes x {len(VIEWS)} views")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m datasets.synthetic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same dataset")
    parser.add_argument("--size", type=int, help="frame width and height in pixels (default 64)")
    parser.add_argument("--fps", type=float, default=25.0, help="frames per second written in the files")
    parser.add_argument("--num-train", type=int, help="short training videos (default 192)")
    parser.add_argument("--num-val", type=int, help="short validation videos (default 48)")
    parser.add_argument("--num-test", type=int, default=48, help="short test videos")
    parser.add_argument("--short-frames", type=int, default=40, help="frames per short video")
    parser.add_argument("--num-long", type=int, default=2, help="long videos with a timeline")
    parser.add_argument("--long-frames", type=int, help="frames per long video (default 3000)")
    parser.add_argument("--num-multiview", type=int, default=48, help="multi-view training scenes (val: half)")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    parser.add_argument(
        "--long-range",
        action="store_true",
        help="write the long-range order task instead (order_train/val.jsonl; see above): "
        "--long-frames (default 1024), --num-train (96), --num-val (48), --size (32)",
    )
    parser.add_argument(
        "--segmentation",
        action="store_true",
        help="write the segmentation task instead (seg_train/val.jsonl; "
        "datasets/segmentation_task.py): --long-frames (default 600), --num-train (48), "
        "--num-val (16), --size (32)",
    )
    parser.add_argument(
        "--mstcn",
        action="store_true",
        help="write the segmentation task as features in MS-TCN's layout instead (features/, groundTruth/, "
        "mapping.txt, splits/ with 2 splits; datasets/mstcn.py): --num-train videos (default 12) of "
        "--long-frames (600) frames",
    )
    parser.add_argument(
        "--mstcn-labels",
        choices=tuple(LABEL_CONVENTIONS),
        default="generic",
        help="--mstcn: label the set as that dataset labels its own (breakfast: SIL at both ends and as background, "
        "first in mapping.txt; 50salads: action_start/action_end at the ends, no background; gtea: background, "
        "last in mapping.txt); generic: background as class 0",
    )
    parser.add_argument(
        "--family",
        choices=tuple(TASKS),
        help="write that long-range task family instead ({family}_train/val.jsonl; datasets/long_range_tasks.py): "
        "--num-train (96), --num-val (48), --size (32), --modality",
    )
    parser.add_argument(
        "--modality",
        choices=MODALITIES,
        default="colour",
        help="--family: what tells its kinds of event apart (colour, a square's motion, texture at one "
        "brightness, a count of pulses)",
    )
    parser.add_argument("--event-frames", type=int, default=12, help="--long-range: frames per event")
    parser.add_argument("--min-gap", type=int, default=320, help="--long-range: frames between the two events")
    args = parser.parse_args(argv)
    for name in ("size", "short_frames", "long_frames"):
        if getattr(args, name) is not None and getattr(args, name) < 8:
            parser.error(f"--{name.replace('_', '-')} must be at least 8")
    if args.mstcn:
        generate_features(
            args.out,
            args.seed,
            args.num_train or 12,
            args.long_frames or 600,
            quiet=args.quiet,
            labels=args.mstcn_labels,
        )
        return 0
    if args.segmentation:
        generate_segmentation(
            args.out,
            args.seed,
            args.size or 32,
            args.fps,
            args.num_train or 48,
            args.num_val or 16,
            args.long_frames or 600,
            quiet=args.quiet,
        )
        return 0
    if args.family:
        generate_task(
            args.out,
            args.family,
            args.seed,
            args.size or 32,
            args.fps,
            args.num_train or 96,
            args.num_val or 48,
            args.quiet,
            args.modality,
        )
        return 0
    if args.long_range:
        generate_long_range(
            args.out,
            args.seed,
            args.size or 32,
            args.fps,
            args.num_train or 96,
            args.num_val or 48,
            args.long_frames or 1024,
            args.event_frames,
            args.min_gap,
            args.quiet,
        )
        return 0
    generate(
        args.out,
        args.seed,
        args.size or 64,
        args.fps,
        args.num_train or 192,
        args.num_val or 48,
        args.num_test,
        args.short_frames,
        args.num_long,
        args.long_frames or 3000,
        args.num_multiview,
        args.quiet,
    )
    return 0


if __name__ == "__main__":
    exit_on_usage_error(main, disk_advice="free space there and run it again")
