"""Loader benchmark: this project's reader (both decoders) against plain OpenCV and PyAV seek-and-decode.

    python -m bench.loader                 # everything below (videos written once to bench/.cache)
    python -m bench.loader --part codecs --frames 1500   # H.264 360p/720p, H.265, MPEG-4 AVI, VP9: random clips,
                                                         # windows, sequential passes; opencv, pyav and auto
    python -m bench.loader --part samples  # the training sample end to end: decode + geometry + augmentation
    python -m bench.loader --part h264 --frames 1500 --sizes 640x360
    python -m bench.loader --part prepared --frames 1500   # 1080p GOP 250 and 30: samples from sources vs copies

Videos: H.264, GOP 250, 3 B-frames, moving shapes over a textured background. Every reader decodes with one
thread (the DataLoader worker setting). Printed per size, in frames per second and as ratios, modes interleaved
and the fastest of --repeat rounds kept:
  (c) a full pass in 64-frame windows   vs a plain cv2 read() loop that drops every frame (target: >= 0.9x);
                                        also a plain loop that keeps each window, and the reader resizing
  (a) random 16-frame clips at stride 2 vs PyAV seek-and-decode (target: the reader faster)
  (b) random 64-frame dense windows     vs PyAV seek-and-decode
and the peak RSS of a process that loads one 16-frame clip from a 300-frame and from a 5,000-frame video
(target: ratio <= 1.1). Without PyAV installed its rows are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

import cv2
import numpy as np
import torch

from datasets.video.choice import open_reader
from datasets.video_files import write_h264

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CACHE = os.path.join(ROOT, "bench", ".cache")


def plain_sequential(path: str, windows) -> int:
    """The ceiling for one core: cv2 read() of every frame into one reused buffer, each frame dropped."""
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
    count, frame = 0, None
    while True:
        ok, frame = cap.read(frame)
        if not ok:
            break
        count += 1
    cap.release()
    return count


def plain_windows(path: str, windows) -> int:
    """A hand-written loader: cv2 read() the frames of each window and stack them (BGR, no conversion)."""
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
    count = 0
    for start, end in windows:
        count += len(np.stack([cap.read()[1] for _ in range(start, end)]))
    cap.release()
    return count


def plain_window_floor(path: str, windows) -> int:
    """The least any loader that returns windows pays: cv2 read() into one reused buffer, then one copy of
    each frame into a new window array (BGR, no conversion)."""
    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
    count, frame = 0, None
    for start, end in windows:
        ok, frame = cap.read(frame)
        window = np.empty((end - start, *frame.shape), np.uint8)
        window[0] = frame
        for k in range(1, end - start):
            ok, frame = cap.read(frame)
            window[k] = frame
        count += len(window)
    cap.release()
    return count


def reader_reads(decoder: str, size=None, access: str = "random"):
    def run(path: str, reads) -> int:
        with open_reader(path, size, threads=1, decoder=decoder, access=access) as reader:
            return sum(len(reader.read(frames)) for frames in reads)

    return run


def pyav_clips(path: str, clips) -> int:
    """Seek to the keyframe before each clip, decode forward, keep the clip's frames (the usual PyAV recipe,
    with one shared converter: frame.to_ndarray() alone builds a new swscale context every frame)."""
    import av
    from av.video.reformatter import VideoReformatter

    count, reformatter = 0, VideoReformatter()
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
                    reformatter.reformat(frame, format="rgb24").to_ndarray()
                    count += 1
                if index >= last:
                    break
    return count


def decord_clips(path: str, clips) -> int:
    """decord's VideoReader, one thread, each clip's frames by get_batch at full size (decord's own recipe)."""
    import decord  # a bench-only anchor: pip install decord

    reader = decord.VideoReader(path, num_threads=1)
    return sum(len(reader.get_batch([int(i) for i in clip]).asnumpy()) for clip in clips)


def anchors() -> list[str]:
    """The other decoders' recipes installed here (decord; torchcodec's PyPI wheel needs CUDA's torch)."""
    import importlib.util

    return [name for name in ("decord",) if importlib.util.find_spec(name) is not None]


def fastest(modes: dict, path: str, repeat: int) -> dict:
    """Frames per second of each mode, fastest of ``repeat`` rounds; modes interleaved in every round so a
    slow minute on a shared machine hits all of them alike."""
    best = {name: 0.0 for name in modes}
    for _ in range(repeat):
        for name, (fn, work) in modes.items():
            start = time.perf_counter()
            frames = fn(path, work)
            best[name] = max(best[name], frames / (time.perf_counter() - start))
    return best


def peak_rss_of_one_clip(path: str, decoder: str) -> float:
    """Peak RSS (MB) of a fresh process that opens the video and loads one 16-frame clip.

    Read from VmHWM: getrusage's ru_maxrss survives exec, so a child started from this (large) process would
    report this process's peak, not its own.
    """
    code = (
        "from datasets.video.choice import open_reader; "
        f"r = open_reader({path!r}, threads=1, decoder={decoder!r}); n = r.num_frames; "
        f"r.read(range(n // 2, n // 2 + 32, 2)); "
        f"print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024)"
    )
    return float(
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    )


def print_table(title: str, fps: dict, baseline: str) -> None:
    print(f"  {title}: frames/s, and vs {baseline}")
    for name, value in fps.items():
        print(f"    {name:<42} {value:8.1f}  {value / fps[baseline]:5.2f}x")


# the loader benchmark's codecs: (write_h264 codec, extension, width, height)
CODEC_VIDEOS = {
    "H.264 640x360": ("h264", "mp4", 640, 360),
    "H.264 1280x720": ("h264", "mp4", 1280, 720),
    "H.265 640x360": ("hevc", "mp4", 640, 360),
    "MPEG-4 AVI 640x360": ("mpeg4", "avi", 640, 360),
    "VP9 640x360": ("vp9", "webm", 640, 360),
}


def codec_rows(frames: int, count: int, repeat: int, rng) -> None:
    """Every codec, every access pattern: the project's decoders (auto included) against the plain recipe."""
    for title, (codec, ext, width, height) in CODEC_VIDEOS.items():
        path = write_h264(
            os.path.join(CACHE, f"{codec}_{width}x{height}_{frames}.{ext}"), frames, width, height, codec=codec
        )
        clips = [int(rng.integers(0, frames - 32)) + np.arange(0, 32, 2) for _ in range(count)]
        dense = [range(s, s + 64) for s in rng.integers(0, frames - 64, size=count // 2)]
        passes = [range(s, min(s + 64, frames)) for s in range(0, frames, 64)]
        print(f"\n{title}, {frames} frames; fastest of {repeat} interleaved rounds")
        for pattern, reads, access in (
            ("random 16-frame clips at stride 2", clips, "random"),
            ("random 64-frame windows", dense, "random"),
            ("sequential pass in 64-frame windows", passes, "sequential"),
        ):
            modes = (
                {"PyAV seek+decode": (pyav_clips, reads)}
                if access == "random"
                else {"plain cv2 read(), every frame dropped": (plain_sequential, reads)}
            )
            modes.update(
                {
                    f"reader, {decoder}": (reader_reads(decoder, access=access), reads)
                    for decoder in ("opencv", "pyav", "auto")
                }
            )
            print_table(pattern, fastest(modes, path, repeat), next(iter(modes)))


def sample_path(frames: int, count: int, repeat: int, rng) -> None:
    """The training sample end to end, one worker: decode + aspect-true resize + random resized crop + flip + colour
    jitter, for the rtx5080 clip (40 frames at stride 2, 160x210) from a long 640x360 H.264 video."""
    from config import load_config
    from datasets.clip_transform import ClipTransform, decode_size
    from datasets.manifest import VideoRecord
    from datasets.video_dataset import VideoWindowDataset

    path = write_h264(os.path.join(CACHE, f"h264_640x360_{frames}.mp4"), frames, 640, 360)
    data = load_config(
        os.path.join(ROOT, "configs", "rtx5080.yaml"),
        ["data.augment=true", "data.color_jitter=0.2", "data.index_cache=null", "data.max_video_frames=200"],
    ).data
    samples = {
        decoder: VideoWindowDataset(
            [VideoRecord({"video": path}, label="a", where="bench")],
            ["a"],
            dataclasses.replace(data, decoder=decoder),
            training=True,
        )
        for decoder in ("opencv", "pyav", "auto")
    }
    order = rng.permutation(len(samples["auto"]))[:count]
    placed = [samples["auto"][int(i)]["frame_indices"].numpy() for i in order]  # the same clips for the recipe

    def dataset_reads(decoder):
        def run(_, indices) -> int:
            return sum(samples[decoder][int(i)]["video"].shape[1] for i in indices)

        return run

    modes = {"PyAV seek+decode (full size, no transform)": (pyav_clips, placed)}
    modes.update({f"dataset sample, {decoder}": (dataset_reads(decoder), order) for decoder in samples})
    print(
        f"\ntraining samples: {data.num_frames} frames at stride {data.frame_stride} -> "
        f"{data.img_size[0]}x{data.img_size[1]} from 640x360 H.264 ({frames} frames, {len(order)} samples), "
        f"augment on (random resized crop, flip, colour jitter 0.2), one process"
    )
    print_table("decode + geometry + augmentation", fastest(modes, path, repeat), next(iter(modes)))
    # the transform's own cost per clip, beside the decode's
    transform = ClipTransform(data, training=True)
    with open_reader(path, decode_size(360, 640, data), threads=1, decoder="auto") as reader:
        start = time.perf_counter()
        decoded = [reader.read(indices) for indices in placed]
        decode_ms = (time.perf_counter() - start) * 1000 / len(placed)
    for colour in (False, True):
        start = time.perf_counter()
        for k, frames_ in enumerate(decoded):
            clip_rng = np.random.default_rng(k)
            [plan] = transform.plan([(360, 640)], clip_rng)
            transform.frames(
                torch.from_numpy(frames_).permute(0, 3, 1, 2),
                plan,
                transform.colour_factors(clip_rng) if colour else None,
            )
        ms = (time.perf_counter() - start) * 1000 / len(decoded)
        print(
            f"    augmentation {'with' if colour else 'without'} colour jitter: {ms:6.2f} ms a clip "
            f"(decode at {decode_size(360, 640, data)}: {decode_ms:6.2f} ms a clip)"
        )


def prepared_rows(frames: int, count: int, repeat: int, rng) -> None:
    """Training samples from 1080p H.264 (GOP 250 and GOP 30, B-frames), from the source and from its prepared copy
    (python -m datasets.prepare's copy at the preset's decode size), for the rtx5080 preset's sample (40 frames at
    stride 2, 160x210) and long-video-16gb's (250 frames at stride 4 from 1,000-frame windows); beside them PyAV's
    seek-and-decode recipe on the source (full size, no transform). Then the preparation: estimated (the command's
    way) and measured, in time and GB per hour of source."""
    import shutil

    from config import load_config
    from datasets.manifest import VideoRecord
    from datasets.prepare import estimate, prepare_one
    from datasets.prepared_copies import preparation_of
    from datasets.video.probe import probe
    from datasets.video_dataset import VideoWindowDataset

    print(f"anchors installed: PyAV{''.join(', ' + a for a in anchors())}")
    for gop in (250, 30):
        path = write_h264(os.path.join(CACHE, f"h264_1920x1080_{frames}_gop{gop}.mp4"), frames, 1920, 1080, gop=gop)
        info = probe(path)
        hours = frames / info.fps / 3600
        for preset in ("rtx5080", "long-video-16gb"):
            folder = os.path.join(CACHE, f"prepared_{preset}")
            data = load_config(
                os.path.join(ROOT, "configs", f"{preset}.yaml"),
                ["data.index_cache=null", f"data.prepared_dir={folder}"],  # the preset's own sample
            ).data
            preparation = preparation_of(info, data)
            shutil.rmtree(folder, ignore_errors=True)
            seconds, size = estimate([(path, info, preparation)], data.decoder)
            start = time.perf_counter()
            copy = prepare_one(path, info, folder, preparation, data.decoder)
            took = time.perf_counter() - start
            print(
                f"\n1920x1080 H.264 GOP {gop}, {frames} frames -> {preset} ({preparation.width}x{preparation.height}, "
                f"GOP {preparation.gop}, crf {preparation.crf}): prepared in {took:.1f} s ({took / hours / 60:.1f} min "
                f"per hour of source; estimated {seconds:.1f} s, {seconds / took:.2f}x), {copy.record['bytes'] / 1e6:.1f} MB "
                f"({copy.record['bytes'] / hours / 1e9:.2f} GB per hour; estimated {size / 1e6:.1f} MB)"
            )
            record = [VideoRecord({"video": path}, label="a", where="bench")] * count  # count sample windows at least
            datasets = {
                "dataset sample, source": dataclasses.replace(data, prepared_dir=None),
                "dataset sample, prepared copy": data,
            }
            samples = {name: VideoWindowDataset(record, ["a"], cfg, training=True) for name, cfg in datasets.items()}
            # as many decoded frames for either preset: count samples of 40 frames, fewer of 250
            order = rng.permutation(len(samples["dataset sample, source"]))[: max(3, count * 40 // data.num_frames)]
            placed = [samples["dataset sample, source"][int(i)]["frame_indices"].numpy() for i in order]

            def dataset_reads(name, samples=samples):
                def run(_, indices) -> int:
                    return sum(samples[name][int(i)]["video"].shape[1] for i in indices)

                return run

            modes = {"PyAV seek+decode of the source (full size)": (pyav_clips, placed)}
            if "decord" in anchors():
                modes["decord get_batch of the source (full size)"] = (decord_clips, placed)
            modes.update({name: (dataset_reads(name), order) for name in samples})
            augment = "augmentation on" if data.augment else "no augmentation (the preset's)"
            print(f"  {preset}: {data.num_frames} frames at stride {data.frame_stride}, {len(order)} random samples")
            print_table(f"decode + geometry, {augment}", fastest(modes, path, repeat), next(iter(modes)))


def copy_reads(copy, size):
    """The reader's reads from a prepared copy (the benchmark's path argument, its source, unused)."""

    def run(_, reads) -> int:
        with open_reader(copy.path, size, threads=1, info=copy.info, decoder="pyav") as reader:
            return sum(len(reader.read(frames)) for frames in reads)

    return run


def encoding_rows(frames: int, count: int, repeat: int, rng) -> None:
    """The copy's encoder options: the rtx5080 copy of the 1080p GOP-250 source with x264's fastdecode tuning (the
    default, ENCODER), without it, and intra-only (every frame a keyframe, data.prepared_gop 1): random 40-frame
    clips at stride 2 read by the reader from each copy, the copy's bytes, and its pixels against the source's read
    at the same size."""
    import shutil

    from config import load_config
    from datasets.prepared_copies import preparation_of
    from datasets.video.prepared import ENCODER, prepare_copy
    from datasets.video.probe import probe

    path = write_h264(os.path.join(CACHE, f"h264_1920x1080_{frames}_gop250.mp4"), frames, 1920, 1080, gop=250)
    info = probe(path)
    preparation = preparation_of(info, load_config(os.path.join(ROOT, "configs", "rtx5080.yaml")).data)
    size = (preparation.height, preparation.width)
    clips = [int(rng.integers(0, frames - 80)) + np.arange(0, 80, 2) for _ in range(count)]
    with open_reader(path, size, threads=1, decoder="pyav") as reader:
        original = [reader.read(clip) for clip in clips[:4]]
    variants = {
        f"fastdecode (ENCODER), GOP {preparation.gop}": (preparation, ENCODER),
        "x264's default tuning": (preparation, {k: v for k, v in ENCODER.items() if k != "tune"}),
        "intra-only (GOP 1), fastdecode": (dataclasses.replace(preparation, gop=1), ENCODER),
    }
    modes, notes = {}, []
    for name, (prepared, encoder) in variants.items():
        folder = os.path.join(CACHE, "prepared_encoding", name.split()[0])
        shutil.rmtree(folder, ignore_errors=True)
        with open_reader(path, size, threads=1, decoder="pyav", access="sequential") as reader:
            copy = prepare_copy(reader, folder, prepared, encoder=encoder)
        with open_reader(copy.path, size, threads=1, info=copy.info, decoder="pyav") as reader:
            error = np.mean([np.abs(reader.read(c).astype(int) - o).mean() for c, o in zip(clips, original)])
        modes[f"reader on the copy, {name}"] = (copy_reads(copy, size), clips)
        notes.append(
            f"{name}: {copy.record['bytes'] / frames / 1e3:.1f} KB a frame, {error:.2f} of 255 from the source"
        )
    print(f"\nthe rtx5080 copy ({preparation.width}x{preparation.height}) of 1920x1080 GOP 250, {count} random clips")
    print_table("random 40-frame clips at stride 2", fastest(modes, path, repeat), next(iter(modes)))
    for note in notes:
        print(f"    {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=3000, help="frames per benchmark video")
    parser.add_argument("--sizes", default="640x360,1280x720", help="comma-separated WIDTHxHEIGHT")
    parser.add_argument("--clips", type=int, default=40, help="random clips/windows per measurement")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the fastest counts")
    parser.add_argument(
        "--train-size",
        default="160x210",
        help="HEIGHTxWIDTH of the resized full-pass row (the rtx5080 preset's img_size)",
    )
    parser.add_argument(
        "--part",
        choices=("all", "h264", "codecs", "samples", "prepared", "encoding"),
        default="all",
        help="h264: the H.264 table and memory; codecs: every codec and access pattern; samples: the "
        "training sample path; prepared: 1080p sources against their prepared copies (--frames of each); "
        "encoding: the copies' encoder options",
    )
    args = parser.parse_args()
    os.makedirs(CACHE, exist_ok=True)
    try:
        import av

        decoders = ["opencv", "pyav"]
        versions = f"PyAV {av.__version__}"
    except ImportError:
        decoders, versions = ["opencv"], "PyAV not installed: its rows are skipped (pip install av)"
    train_size = tuple(map(int, args.train_size.split("x")))
    rng = np.random.default_rng(0)
    print(f"opencv {cv2.__version__}, {versions}, {os.cpu_count()} CPUs, one decoder thread everywhere")
    if args.part in ("all", "codecs"):
        codec_rows(args.frames, args.clips, args.repeat, rng)
    if args.part in ("all", "samples"):
        sample_path(6000, args.clips, args.repeat, rng)
    if args.part in ("all", "prepared"):
        prepared_rows(args.frames, args.clips, args.repeat, rng)
    if args.part in ("all", "encoding"):
        encoding_rows(args.frames, args.clips, args.repeat, rng)
    if args.part not in ("all", "h264"):
        return
    for size in args.sizes.split(","):
        width, height = map(int, size.split("x"))
        path = write_h264(os.path.join(CACHE, f"h264_{width}x{height}_{args.frames}.mp4"), args.frames, width, height)
        n = args.frames
        clips = [int(rng.integers(0, n - 32)) + np.arange(0, 32, 2) for _ in range(args.clips)]
        dense = [range(s, s + 64) for s in rng.integers(0, n - 64, size=args.clips // 2)]
        windows = [(s, min(s + 64, n)) for s in range(0, n, 64)]
        print(f"\n{width}x{height}, {n} frames, H.264 GOP 250 with B-frames; fastest of {args.repeat} rounds")
        full = {
            "plain cv2 read(), every frame dropped": (plain_sequential, windows),
            "plain cv2 read(), each window stacked": (plain_windows, windows),
            "plain cv2 read(), copied into each window": (plain_window_floor, windows),
        }
        for decoder in decoders:
            full[f"reader, {decoder}"] = (reader_reads(decoder), [range(s, e) for s, e in windows])
        full[f"reader, opencv, resized to {args.train_size}"] = (
            reader_reads("opencv", train_size),
            [range(s, e) for s, e in windows],
        )
        print_table(
            "(c) full pass in 64-frame windows",
            fastest(full, path, args.repeat),
            "plain cv2 read(), every frame dropped",
        )
        for title, reads in (("(a) random 16-frame clips at stride 2", clips), ("(b) random 64-frame windows", dense)):
            modes = {"PyAV seek+decode": (pyav_clips, reads)} if "pyav" in decoders else {}
            modes.update({f"reader, {decoder}": (reader_reads(decoder), reads) for decoder in decoders})
            print_table(title, fastest(modes, path, args.repeat), next(iter(modes)))
    short = write_h264(os.path.join(CACHE, "h264_640x360_300.mp4"), 300, 640, 360)
    long = write_h264(os.path.join(CACHE, "h264_640x360_5000.mp4"), 5000, 640, 360)
    for decoder in decoders:
        rss_short, rss_long = peak_rss_of_one_clip(short, decoder), peak_rss_of_one_clip(long, decoder)
        print(
            f"\npeak RSS loading one 16-frame clip (640x360, {decoder}): 300-frame video {rss_short:.1f} MB, "
            f"5,000-frame video {rss_long:.1f} MB, ratio {rss_long / rss_short:.3f}"
        )


if __name__ == "__main__":
    main()
