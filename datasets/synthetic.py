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

With ``--long-range`` (``generate_long_range``) it writes instead the long-range order task, where a label depends
on what happens across chunks (``bench/long_range.py`` trains on it):

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

The output directory is built under a temporary name and renamed when complete, so an interrupted run
never leaves a half-written dataset; a complete one with the same arguments is left as it is.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import cv2
import numpy as np

from core.cli import exit_on_usage_error
from core.files import atomic_path

CLASSES = ("down", "grow", "left", "right", "shrink", "up")
SHAPES = ("square", "disc", "triangle")
VIEWS = ("front", "left", "right")
NUM_JOINTS = 5
MARKER = ".complete.json"


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
        frame[offset:offset + inner.shape[0], offset:offset + inner.shape[1]] = inner
    corners = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1], [0, 0]], np.float32) * half + centre
    keypoints = np.concatenate([corners / size, np.ones((NUM_JOINTS, 1), np.float32)], axis=1)
    return frame, keypoints.astype(np.float32)


def _draw_shape(frame, shape, cx, cy, half, colour):
    shift = 4  # sub-pixel positions (cv2 fixed point), so slow motion is not quantised to whole pixels
    scale = 1 << shift
    if shape == "square":
        pts = np.array([[cx - half, cy - half], [cx + half, cy - half], [cx + half, cy + half],
                        [cx - half, cy + half]])
        cv2.fillPoly(frame, [np.round(pts * scale).astype(np.int32)], colour, cv2.LINE_AA, shift)
    elif shape == "disc":
        cv2.circle(frame, (round(cx * scale), round(cy * scale)), round(half * scale), colour, -1, cv2.LINE_AA, shift)
    else:
        pts = np.array([[cx, cy - half], [cx + half, cy + half], [cx - half, cy + half]])
        cv2.fillPoly(frame, [np.round(pts * scale).astype(np.int32)], colour, cv2.LINE_AA, shift)


def write_video(path: str, frames_iter, size: int, fps: float) -> None:
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
    if not writer.isOpened():
        raise RuntimeError(f"{path}: OpenCV cannot open an MPEG-4 video writer")
    try:
        for frame in frames_iter:
            writer.write(frame)
    finally:
        writer.release()


ORDER_CLASSES = ("A_then_B", "B_then_A")
EVENT_COLOURS = {"A": (0, 0, 255), "B": (0, 255, 0), "C": (255, 0, 0)}  # BGR: A red, B green, C blue


def order_video(rng: np.random.Generator, label: str, frames: int, size: int, event_frames: int,
                min_gap: int) -> tuple[list[np.ndarray], dict]:
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


def events_video(rng: np.random.Generator, events: list[tuple[str, int]], frames: int, size: int,
                 event_frames: int) -> list[np.ndarray]:
    """Grey frames with fresh noise (no frame tells its time) and each (colour, start) event tinting
    ``event_frames`` frames."""
    video = []
    for t in range(frames):
        frame = rng.integers(90, 166, size=(size, size, 3), dtype=np.uint8)
        for name, start in events:
            if start <= t < start + event_frames:
                frame = (0.4 * frame + 0.6 * np.array(EVENT_COLOURS[name])).astype(np.uint8)
        video.append(frame)
    return video


# Long-range task families beside the order of two events. Each draws its event times without looking at the label
# and gives every label the same multiset of events, so a bag of chunks (mean, max or any order-blind pooling of
# per-chunk scores) sees the same thing under every label: at chance by construction. The label is in the order.
#   middle       three events, one of each colour A, B, C, in a random order: the colour of the middle one
#   last         four events, two A and two B, in a random order: the colour of the last one
#   distractors  A and B once each among 2 to 4 C events, all in a random order: which of A and B came first
# Each has its own shape (video length, event length, gap), so no single shape is tuned.
TASKS = {
    "middle": {"classes": ("middle_A", "middle_B", "middle_C"), "frames": 384, "event_frames": 8, "min_gap": 96},
    "last": {"classes": ("last_A", "last_B"), "frames": 640, "event_frames": 12, "min_gap": 64},
    "distractors": {"classes": ("A_first", "B_first"), "frames": 1024, "event_frames": 6, "min_gap": 48},
}


def task_events(rng: np.random.Generator, task: str, label: str) -> list[str]:
    """The colours of a ``task`` video's events in time order, for ``label``."""
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


def generate_task(out: str, task: str, seed: int = 0, size: int = 32, fps: float = 25.0, num_train: int = 96,
                  num_val: int = 48, quiet: bool = False, **shape) -> str:
    """Write a long-range task family (``TASKS``) to ``out``: ``videos/``, ``{task}_train.jsonl``,
    ``{task}_val.jsonl`` (each line with its events), ``classes.txt``; skipped when complete with the same
    arguments. ``shape``: frames, event_frames or min_gap other than the family's (small tests)."""
    spec = {**TASKS[task], **shape}
    args = dict(kind=f"task_{task}", seed=seed, size=size, fps=fps, num_train=num_train, num_val=num_val,
                **{**spec, "classes": list(spec["classes"])})  # as the marker's JSON gives it back

    def write(root: str) -> None:
        rng = np.random.default_rng(seed)
        os.makedirs(os.path.join(root, "videos"))
        with open(os.path.join(root, "classes.txt"), "w") as f:
            f.write("\n".join(spec["classes"]) + "\n")
        for split, count in (("train", num_train), ("val", num_val)):
            lines = []
            for i in range(count):
                label = spec["classes"][i % len(spec["classes"])]
                colours = task_events(rng, task, label)
                times = event_times(rng, len(colours), spec["frames"], spec["event_frames"], spec["min_gap"])
                events = list(zip(colours, times))
                path = f"videos/{task}_{split}_{i:04d}.mp4"
                write_video(os.path.join(root, path),
                            events_video(rng, events, spec["frames"], size, spec["event_frames"]), size, fps)
                lines.append({"video": path, "label": label, "events": events})
            _write_jsonl(os.path.join(root, f"{task}_{split}.jsonl"), lines)
            if not quiet:
                print(f"  {task} {split}: {count} videos of {spec['frames']} frames")

    return _build_once(out, args, write, quiet)


def generate_long_range(out: str, seed: int = 0, size: int = 32, fps: float = 25.0, num_train: int = 96,
                        num_val: int = 48, frames: int = 1024, event_frames: int = 12, min_gap: int = 320,
                        quiet: bool = False) -> str:
    """Write the long-range order task (module docstring) to ``out``; skipped when a complete one with the same
    arguments is there."""
    if frames < 2 * event_frames + min_gap:
        raise SystemExit(f"error: --long-frames {frames} cannot hold two events of {event_frames} frames "
                         f"{min_gap} apart; give at least {2 * event_frames + min_gap}")
    args = dict(kind="long_range", seed=seed, size=size, fps=fps, num_train=num_train, num_val=num_val,
                frames=frames, event_frames=event_frames, min_gap=min_gap)

    def write(root: str) -> None:
        rng = np.random.default_rng(seed)
        os.makedirs(os.path.join(root, "videos"))
        with open(os.path.join(root, "classes.txt"), "w") as f:
            f.write("\n".join(ORDER_CLASSES) + "\n")
        for split, count in (("train", num_train), ("val", num_val)):
            lines = []
            for i in range(count):
                label = ORDER_CLASSES[i % 2]
                video, events = order_video(rng, label, frames, size, event_frames, min_gap)
                path = f"videos/order_{split}_{i:04d}.mp4"
                write_video(os.path.join(root, path), video, size, fps)
                lines.append({"video": path, "label": label, "events": events})
            _write_jsonl(os.path.join(root, f"order_{split}.jsonl"), lines)
            if not quiet:
                print(f"  {split}: {count} videos of {frames} frames, events of {event_frames} frames at least "
                      f"{min_gap} apart")

    return _build_once(out, args, write, quiet)


def generate(out: str, seed: int = 0, size: int = 64, fps: float = 25.0, num_train: int = 192, num_val: int = 48,
             num_test: int = 48, short_frames: int = 40, num_long: int = 2, long_frames: int = 3000,
             num_multiview: int = 48, quiet: bool = False) -> str:
    """Write the dataset to ``out`` (skipped when a complete one with the same arguments is there)."""
    args = dict(seed=seed, size=size, fps=fps, num_train=num_train, num_val=num_val, num_test=num_test,
                short_frames=short_frames, num_long=num_long, long_frames=long_frames, num_multiview=num_multiview)

    def write(root: str) -> None:
        _generate_into(root, np.random.default_rng(seed), quiet=quiet,
                       **{k: v for k, v in args.items() if k != "seed"})

    return _build_once(out, args, write, quiet)


def _build_once(out: str, args: dict, write, quiet: bool) -> str:
    """``write(directory)`` into a temporary directory renamed to ``out`` when complete; nothing when ``out``
    already holds a complete dataset made with ``args``."""
    marker = os.path.join(out, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == args:
                if not quiet:
                    print(f"synthetic dataset already in {out}; skipping generation")
                return out
        raise SystemExit(f"error: {out} holds a synthetic dataset made with other arguments; "
                         f"remove it or choose another --out")
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"error: {out} exists and is not a synthetic dataset; choose another --out")

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".synthetic-", dir=parent)
    try:
        write(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(args, f)
        if os.path.exists(out):
            os.rmdir(out)  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not quiet:
        print(f"synthetic dataset written to {out}")
    return out


def _generate_into(root: str, rng: np.random.Generator, size: int, fps: float, num_train: int, num_val: int,
                   num_test: int, short_frames: int, num_long: int, long_frames: int, num_multiview: int,
                   quiet: bool) -> None:
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
        _write_jsonl(os.path.join(root, f"{split}.jsonl"), lines)
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
    _write_jsonl(os.path.join(root, "long.jsonl"), lines)
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
                write_video(os.path.join(root, path), (draw(scene, t, view)[0] for t in range(short_frames)),
                            size, fps)
                views[view] = path
            lines.append({"views": views, "label": label})
        _write_jsonl(os.path.join(root, f"multiview_{split}.jsonl"), lines)
    if not quiet:
        print(f"  multi-view: {num_multiview} + {num_multiview // 2} scenes x {len(VIEWS)} views")


def _write_jsonl(path: str, lines: list[dict]) -> None:
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m datasets.synthetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--long-range", action="store_true",
                        help="write the long-range order task instead (order_train/val.jsonl; see above): "
                             "--long-frames (default 1024), --num-train (96), --num-val (48), --size (32)")
    parser.add_argument("--event-frames", type=int, default=12, help="--long-range: frames per event")
    parser.add_argument("--min-gap", type=int, default=320, help="--long-range: frames between the two events")
    args = parser.parse_args(argv)
    for name in ("size", "short_frames", "long_frames"):
        if getattr(args, name) is not None and getattr(args, name) < 8:
            parser.error(f"--{name.replace('_', '-')} must be at least 8")
    if args.long_range:
        generate_long_range(args.out, args.seed, args.size or 32, args.fps, args.num_train or 96, args.num_val or 48,
                            args.long_frames or 1024, args.event_frames, args.min_gap, args.quiet)
        return 0
    generate(args.out, args.seed, args.size or 64, args.fps, args.num_train or 192, args.num_val or 48,
             args.num_test, args.short_frames, args.num_long, args.long_frames or 3000, args.num_multiview,
             args.quiet)
    return 0


if __name__ == "__main__":
    exit_on_usage_error(main, disk_advice="free space there and run it again")


# the benchmarks' codecs: (PyAV encoder, options). GOPs as cameras and downloads have them: H.264 and VP9 long
# (250 frames) with B-frames / alt-ref frames, MPEG-4 Part 2 in AVI short (12), as older tools write it
CAMERA_CODECS = {
    "h264": ("libx264", {"g": "250", "keyint_min": "250", "bf": "3", "sc_threshold": "0", "preset": "veryfast",
                         "crf": "23"}),
    "hevc": ("libx265", {"g": "250", "bf": "3", "preset": "veryfast", "crf": "28", "x265-params": "log-level=error"}),
    "mpeg4": ("mpeg4", {"g": "12", "bf": "2", "qscale": "4"}),
    "vp9": ("libvpx-vp9", {"g": "250", "deadline": "realtime", "cpu-used": "8", "crf": "32", "b": "0"}),
}


def write_h264(path: str, frames: int, width: int, height: int, fps: int = 25, codec: str = "h264") -> str:
    """A camera-like video (moving texture and shapes) for the benchmarks, in ``codec`` (CAMERA_CODECS; the
    container follows the path's extension); kept if it exists. Needs PyAV (OpenCV's wheel cannot encode H.264)."""
    if os.path.exists(path):
        return path
    import av  # lazy: PyAV is optional at run time; only the benchmarks' camera-like videos need it here
    rng = np.random.default_rng(0)
    texture = cv2.resize(rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8), (width, height))
    encoder, options = CAMERA_CODECS[codec]
    with atomic_path(path) as tmp, av.open(tmp, "w") as container:  # the temp name keeps the extension
        stream = container.add_stream(encoder, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(options)
        for t in range(frames):
            frame = np.roll(texture, t * 2, axis=1).copy()
            for k in range(4):
                cx = int((np.sin(t / (20 + 7 * k)) * 0.4 + 0.5) * width)
                cy = int((np.cos(t / (15 + 5 * k)) * 0.4 + 0.5) * height)
                cv2.circle(frame, (cx, cy), height // 10, (40 * k, 255 - 50 * k, 128), -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
