"""Writing the project's own videos and datasets: MPEG-4 clips with OpenCV, camera-like H.264/H.265/MPEG-4/VP9 with
PyAV for the benchmarks, JSONL manifests, and a dataset directory that appears only when complete."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import cv2
import numpy as np

from core.files import atomic_path

MARKER = ".complete.json"


def write_video(path: str, frames_iter, size: int, fps: float) -> None:
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
    if not writer.isOpened():
        raise RuntimeError(f"{path}: OpenCV cannot open an MPEG-4 video writer")
    try:
        for frame in frames_iter:
            writer.write(frame)
    finally:
        writer.release()


def _made_with(marker: str, args: dict) -> bool:
    with open(marker) as f:
        return json.load(f) == args


def build_once(out: str, args: dict, write, quiet: bool) -> str:
    """``write(directory)`` into a temporary directory renamed to ``out`` when complete; nothing when ``out``
    already holds a complete dataset made with ``args``."""
    marker = os.path.join(out, MARKER)
    if os.path.exists(marker):
        if _made_with(marker, args):
            if not quiet:
                print(f"synthetic dataset already in {out}; skipping generation")
            return out
        raise SystemExit(
            f"error: {out} holds a synthetic dataset made with other arguments; remove it or choose another --out"
        )
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"error: {out} exists and is not a synthetic dataset; choose another --out")

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".synthetic-", dir=parent)
    try:
        write(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(args, f)
        if os.path.exists(marker) and _made_with(marker, args):  # another process wrote the same meanwhile
            shutil.rmtree(tmp)
            return out
        if os.path.exists(out):
            os.rmdir(out)  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not quiet:
        print(f"synthetic dataset written to {out}")
    return out


def write_task_splits(
    root: str, name: str, classes, counts: dict, sample, size: int, fps: float, seed: int, describe=None
) -> None:
    """A task's ``videos/{name}_{split}_NNNN.mp4``, ``{name}_{split}.jsonl`` and ``classes.txt`` under ``root``:
    ``sample(rng, split, i)`` gives each video's frames and its manifest line (without "video"), drawing from one
    generator seeded with ``seed`` in split and index order; ``describe(split, count)``: a line printed per split."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "videos"))
    with open(os.path.join(root, "classes.txt"), "w") as f:
        f.write("\n".join(classes) + "\n")
    for split, count in counts.items():
        lines = []
        for i in range(count):
            video, line = sample(rng, split, i)
            path = f"videos/{name}_{split}_{i:04d}.mp4"
            write_video(os.path.join(root, path), video, size, fps)
            lines.append({"video": path, **line})
        write_jsonl(os.path.join(root, f"{name}_{split}.jsonl"), lines)
        if describe is not None:
            print(describe(split, count))


def write_jsonl(path: str, lines: list[dict]) -> None:
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


# the benchmarks' codecs: (PyAV encoder, options). GOPs as cameras and downloads have them: H.264 and VP9 long
# (250 frames) with B-frames / alt-ref frames, MPEG-4 Part 2 in AVI short (12), as older tools write it
CAMERA_CODECS = {
    "h264": (
        "libx264",
        {"g": "250", "keyint_min": "250", "bf": "3", "sc_threshold": "0", "preset": "veryfast", "crf": "23"},
    ),
    "hevc": ("libx265", {"g": "250", "bf": "3", "preset": "veryfast", "crf": "28", "x265-params": "log-level=error"}),
    "mpeg4": ("mpeg4", {"g": "12", "bf": "2", "qscale": "4"}),
    "vp9": ("libvpx-vp9", {"g": "250", "deadline": "realtime", "cpu-used": "8", "crf": "32", "b": "0"}),
}


def write_h264(
    path: str, frames: int, width: int, height: int, fps: int = 25, codec: str = "h264", gop: int | None = None
) -> str:
    """A camera-like video (moving texture and shapes) for the benchmarks, in ``codec`` (CAMERA_CODECS; the
    container follows the path's extension; ``gop``: frames between keyframes instead of the codec's camera-like
    GOP); kept if it exists. Needs PyAV (OpenCV's wheel cannot encode H.264)."""
    if os.path.exists(path):
        return path
    import av  # lazy: PyAV is optional at run time; only the benchmarks' camera-like videos need it here

    rng = np.random.default_rng(0)
    texture = cv2.resize(rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8), (width, height))
    encoder, options = CAMERA_CODECS[codec]
    with atomic_path(path) as tmp, av.open(tmp, "w") as container:  # the temp name keeps the extension
        stream = container.add_stream(encoder, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(options) | ({"g": str(gop), "keyint_min": str(gop)} if gop else {})
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
