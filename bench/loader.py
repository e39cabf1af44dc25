"""Loader benchmark: this project's OpenCV reader against a plain sequential decode and PyAV seek-and-decode.

    python bench/loader.py                 # 640x360 and 1280x720, 3,000 frames each (written once to bench/.cache)
    python bench/loader.py --frames 1500 --sizes 640x360

Videos: H.264, GOP 250, 3 B-frames, moving shapes over a textured background. Every reader decodes with one
thread (the DataLoader worker setting). Printed per size, in frames per second and as ratios:
  (a) random 16-frame clips at stride 2     reader vs PyAV seek-and-decode (target: reader faster)
  (c) a full pass in 64-frame windows       reader vs plain cv2 sequential read (target: >= 0.9x)
  (b) random 64-frame dense windows         reader vs PyAV seek-and-decode
and the peak RSS of a process that loads one 16-frame clip from a 300-frame and from a 5,000-frame video
(target: ratio <= 1.1).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import cv2
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from datasets.video_reader import VideoReader  # noqa: E402

CACHE = os.path.join(ROOT, "bench", ".cache")


def write_h264(path: str, frames: int, width: int, height: int, fps: int = 25) -> str:
    if os.path.exists(path):
        return path
    import av
    rng = np.random.default_rng(0)
    texture = cv2.resize(rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8), (width, height))
    tmp = path + ".tmp.mp4"
    with av.open(tmp, "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"g": "250", "keyint_min": "250", "bf": "3", "sc_threshold": "0", "preset": "veryfast",
                          "crf": "23"}
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
    os.replace(tmp, path)
    return path


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    frames = fn()
    return time.perf_counter() - start, frames


def plain_sequential(path: str) -> int:
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
    count = 0
    while cap.read()[0]:
        count += 1
    cap.release()
    return count


def reader_windows(path: str, windows) -> int:
    reader = VideoReader(path, threads=1)
    count = sum(len(reader.read(range(s, e))) for s, e in windows)
    reader.close()
    return count


def reader_clips(path: str, clips) -> int:
    reader = VideoReader(path, threads=1)
    count = sum(len(reader.read(c)) for c in clips)
    reader.close()
    return count


def pyav_clips(path: str, clips) -> int:
    """Seek to the keyframe before each clip, decode forward, keep the clip's frames (the usual PyAV recipe)."""
    import av
    count = 0
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type, stream.codec_context.thread_count = "SLICE", 1
        fps = float(stream.average_rate)
        for clip in clips:
            wanted = set(int(i) for i in clip)
            last = max(wanted)
            container.seek(int(min(wanted) / fps / stream.time_base), stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                index = int(round(float(frame.pts * stream.time_base) * fps))
                if index in wanted:
                    frame.to_ndarray(format="rgb24")
                    count += 1
                if index >= last:
                    break
    return count


def peak_rss_of_one_clip(path: str) -> float:
    code = (f"import sys, resource; sys.path.insert(0, {ROOT!r}); from datasets.video_reader import VideoReader; "
            f"r = VideoReader({path!r}, threads=1); n = r.num_frames; r.read(range(n // 2, n // 2 + 32, 2)); "
            f"print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=3000, help="frames per benchmark video")
    parser.add_argument("--sizes", default="640x360,1280x720", help="comma-separated WIDTHxHEIGHT")
    parser.add_argument("--clips", type=int, default=40, help="random clips/windows per measurement")
    args = parser.parse_args()
    os.makedirs(CACHE, exist_ok=True)
    try:
        import av  # noqa: F401
        have_pyav = True
    except ImportError:
        have_pyav = False
        print("PyAV not installed: the PyAV columns are skipped (pip install av)")
    rng = np.random.default_rng(0)
    print(f"opencv {cv2.__version__}, {os.cpu_count()} CPUs, one decoder thread everywhere")
    for size in args.sizes.split(","):
        width, height = map(int, size.split("x"))
        path = write_h264(os.path.join(CACHE, f"h264_{width}x{height}_{args.frames}.mp4"), args.frames, width, height)
        n = args.frames
        clips = [int(rng.integers(0, n - 32)) + np.arange(0, 32, 2) for _ in range(args.clips)]
        dense = [(s, s + 64) for s in rng.integers(0, n - 64, size=args.clips // 2)]
        sequential = [(s, min(s + 64, n)) for s in range(0, n, 64)]
        print(f"\n{width}x{height}, {n} frames, H.264 GOP 250 with B-frames")
        base_t, base_n = timed(lambda: plain_sequential(path))
        seq_t, seq_n = timed(lambda: reader_windows(path, sequential))
        print(f"  (c) full pass, 64-frame windows: reader {seq_n / seq_t:7.1f} fps | plain cv2 sequential "
              f"{base_n / base_t:7.1f} fps | ratio {(seq_n / seq_t) / (base_n / base_t):.2f}x")
        for label, work, frames_per in (("(a) random 16-frame clips, stride 2", clips, 16),
                                        ("(b) random 64-frame dense windows ", [range(s, e) for s, e in dense], 64)):
            t, count = timed(lambda: reader_clips(path, work))
            line = f"  {label}: reader {count / t:7.1f} fps ({len(work) / t:5.1f} clips/s)"
            if have_pyav:
                pt, pcount = timed(lambda: pyav_clips(path, work))
                line += f" | PyAV seek+decode {pcount / pt:7.1f} fps | ratio {(count / t) / (pcount / pt):.2f}x"
            print(line)
    short = write_h264(os.path.join(CACHE, "h264_640x360_300.mp4"), 300, 640, 360)
    long = write_h264(os.path.join(CACHE, "h264_640x360_5000.mp4"), 5000, 640, 360)
    rss_short, rss_long = peak_rss_of_one_clip(short), peak_rss_of_one_clip(long)
    print(f"\npeak RSS loading one 16-frame clip (640x360): 300-frame video {rss_short:.1f} MB, 5,000-frame video "
          f"{rss_long:.1f} MB, ratio {rss_long / rss_short:.3f}")


if __name__ == "__main__":
    main()
