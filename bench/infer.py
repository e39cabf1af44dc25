"""Streaming chunked inference benchmark: memory and time against video length.

    python -m bench.infer                                # 600, 6,000 and 30,000 frames (written once to bench/.cache)
    python -m bench.infer --lengths 600,6000 --size 320x180
    python -m bench.infer --features --lengths 6000,30000   # feature extraction against plain classification

Each measurement runs in a fresh process (peak RSS is per process), --repeat times, the modes interleaved; the
fastest run of each is reported. For every video length it prints the peak
host RSS and wall time of infer_chunked's streaming path (--agg mean) with the busy time of its decode thread and
of its model, the ratio wall / max(decode, compute) (target <= 1.2: decode and compute overlap), the time of
decoding alone and of computing alone (the same chunks through the model, in processes of their own), and the
same for --agg last (only the last chunk: independent of length). Then the
decoder's multi-thread speed-up on one full pass (threads = OpenCV's default vs 1). The model is a tiny3d at the
given clip size on --device; on the CPU it gets --torch-threads threads (1 by default, so decode and compute each
have a core of a 2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from bench.worker import parse_or_measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CACHE = os.path.join(ROOT, "bench", ".cache")


def measure(args) -> dict:
    """One measurement in this process: mode full | last | decode | compute | features."""
    import torch

    import infer_chunked
    from config import load_config
    from core.runtime import setup_runtime
    from datasets.chunk_stream import ChunkStream
    from datasets.device_input import DeviceInputs
    from datasets.manifest import VideoRecord
    from engine.inference.stream import InferenceSpec
    from models import build_model

    torch.set_num_threads(args.torch_threads)
    cfg = load_config(
        None,
        [
            "model.backbone=tiny3d",
            f"model.width={args.width}",
            f"data.img_size={args.img}",
            "data.frame_stride=1",
            f"trainer.device={args.device}",
        ],
    )
    runtime = setup_runtime(cfg.trainer)
    model = build_model(cfg.model, num_classes=6).to(runtime.device).eval()
    record = VideoRecord({"video": args.video}, where=args.video)
    spec = InferenceSpec(
        args.chunk,
        args.overlap,
        "last" if args.mode == "last" else "mean",
        args.batch,
        decode_threads=args.decode_threads or None,
    )
    device_inputs = DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std)
    start = time.perf_counter()
    result: dict = {}
    if args.mode in ("full", "last", "features"):
        features = args.mode == "features"  # infer_chunked.py --features: the features kept, then written
        out = infer_chunked.classify_video(
            model, record, cfg.data, spec, runtime, device_inputs, [str(i) for i in range(6)], keep_features=features
        )
        if features:
            import tempfile

            from engine.inference.features import settings_of, write_features

            with tempfile.TemporaryDirectory() as folder:
                write_features(
                    os.path.join(folder, "v.npz"),
                    out,
                    record,
                    cfg,
                    settings_of(cfg, args.chunk, args.overlap, "float16", "-"),
                    [str(i) for i in range(6)],
                )
        result.update(decode_s=out.decode_s, compute_s=out.compute_s, chunks=out.chunks)
    elif args.mode == "decode":
        stream = ChunkStream(
            record, dataclasses.replace(cfg.data, frame_stride=1, load_rgb=True, load_kpt=False, decoder="opencv"), spec
        )
        result["chunks"] = sum(len(windows) for windows, _ in stream)
        stream.close()
    else:  # compute alone: the same number of chunks, already decoded
        from datasets.video.probe import probe
        from datasets.windows import inference_windows

        windows = inference_windows(probe(args.video).num_frames, args.chunk, args.overlap, "mean")
        size = cfg.data.img_size
        # the layout the stream hands over: decoded [n, L, H, W, 3] frames, permuted (not copied) to [n, C, L, H, W]
        frames = torch.randint(0, 256, (args.batch, args.chunk, size[0], size[1], 3), dtype=torch.uint8)
        dummy = {"video": frames.permute(0, 4, 1, 2, 3)}
        with torch.inference_mode():
            for _ in range(0, len(windows), args.batch):
                model(device_inputs(dummy))
        result["chunks"] = len(windows)
    result["wall_s"] = time.perf_counter() - start
    # VmHWM, not ru_maxrss: a child started by this benchmark inherits the parent's ru_maxrss through fork and exec
    with open("/proc/self/status") as f:
        result["peak_rss_mb"] = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    if runtime.device.type == "cuda":
        result["device_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def run_interleaved(video: str, modes: tuple, args) -> list[dict]:
    """Each mode --repeat times, interleaved (a b c d a b c d ...), the fastest run of each kept: the shared
    machine's speed drifts by tens of percent between minutes, and interleaving gives every mode the same drift."""
    runs: dict[str, list] = {mode: [] for mode in modes}
    for _ in range(args.repeat):
        for mode in modes:
            runs[mode].append(run(video, mode, args, repeat=1))
    return [min(runs[mode], key=lambda r: r["wall_s"]) for mode in modes]


def run(video: str, mode: str, args, decode_threads: int | None = None, repeat: int | None = None) -> dict:
    command = [
        sys.executable,
        "-m",
        "bench.infer",
        "--worker",
        "--video",
        video,
        "--mode",
        mode,
        "--chunk",
        str(args.chunk),
        "--overlap",
        str(args.overlap),
        "--batch",
        str(args.batch),
        "--img",
        str(args.img),
        "--width",
        str(args.width),
        "--device",
        args.device,
        "--torch-threads",
        str(args.torch_threads),
        "--decode-threads",
        str(args.decode_threads if decode_threads is None else decode_threads),
    ]
    # glibc gives each thread (the decode thread, torch's) its own malloc arena: peak RSS then varies by hundreds of
    # MB from run to run (1.0-1.6 GB for the same 30,000-frame video); two arenas make it repeatable
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    runs = [
        json.loads(
            subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True, env=env)
            .stdout.strip()
            .splitlines()[-1]
        )
        for _ in range(repeat or args.repeat)
    ]
    return min(runs, key=lambda r: r["wall_s"])  # the least disturbed run: the machine is shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="600,6000,30000", help="video lengths in frames")
    parser.add_argument("--size", default="640x360", help="WIDTHxHEIGHT of the generated videos")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--overlap", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="chunks per forward call")
    parser.add_argument("--img", type=int, default=112, help="model input size (frames are resized to it)")
    parser.add_argument("--width", type=int, default=16, help="tiny3d width")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is reported")
    parser.add_argument(
        "--decode-threads",
        type=int,
        default=1,
        help="decoder threads of the overlap measurements (0 = OpenCV's default)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="CPU threads of the model: on a CPU-only machine, decode and compute overlap only if "
        "they do not both want every core",
    )
    parser.add_argument(
        "--features",
        action="store_true",
        help="compare feature extraction (infer_chunked.py --features) with plain classification",
    )
    args = parse_or_measure(parser, measure, video=str, mode=str)
    if args is None:
        return
    if args.features:
        return compare_features(args)
    from datasets.video_files import write_h264

    os.makedirs(CACHE, exist_ok=True)
    width, height = map(int, args.size.split("x"))
    print(
        f"tiny3d width {args.width} at {args.img}x{args.img} on {args.device} ({args.torch_threads} torch threads); "
        f"chunk {args.chunk} overlap {args.overlap}, {args.batch} chunks per forward; H.264 {width}x{height} "
        f"(GOP 250, B-frames), {args.decode_threads or 'default'} decoder threads, {os.cpu_count()} CPUs"
    )
    print(
        "in the streamed run: its wall time, the decode thread's busy time and the model's; wall/max is the wall time "
        "over the larger of the two (1.0 = fully overlapped). Alone: each in a process of its own."
    )
    print(
        f"{'frames':>7s} {'chunks':>6s} {'peak RSS':>9s} {'wall':>8s} {'decode':>8s} {'compute':>8s} "
        f"{'wall/max':>8s} | {'decode alone':>12s} {'compute alone':>13s} | {'last: RSS':>9s} {'wall':>7s}"
    )
    first_rss = None
    for length in [int(n) for n in args.lengths.split(",")]:
        video = write_h264(os.path.join(CACHE, f"h264_{width}x{height}_{length}.mp4"), length, width, height)
        full, decode, compute, last = run_interleaved(video, ("full", "decode", "compute", "last"), args)
        first_rss = first_rss or full["peak_rss_mb"]
        ratio = full["wall_s"] / max(full["decode_s"], full["compute_s"])
        print(
            f"{length:7d} {full['chunks']:6d} {full['peak_rss_mb']:7.0f}MB {full['wall_s']:7.1f}s "
            f"{full['decode_s']:7.1f}s {full['compute_s']:7.1f}s {ratio:7.2f}x | {decode['wall_s']:11.1f}s "
            f"{compute['wall_s']:12.1f}s | {last['peak_rss_mb']:7.0f}MB {last['wall_s']:6.2f}s"
            + (f"  device peak {full['device_peak_mb']:.0f} MB" if "device_peak_mb" in full else "")
        )
    print(f"peak RSS, longest vs shortest video: {full['peak_rss_mb'] / first_rss:.3f}x")
    one = run(video, "decode", args, decode_threads=1)
    many = run(video, "decode", args, decode_threads=0)
    print(
        f"decode alone, {length} frames: 1 thread {one['wall_s']:.1f}s, OpenCV default threads "
        f"{many['wall_s']:.1f}s: {one['wall_s'] / many['wall_s']:.2f}x"
    )


def compare_features(args) -> None:
    """Feature extraction against infer_chunked.py's plain classification of the same video: chunks per second
    and peak host RSS of each, interleaved, the fastest of --repeat kept."""
    from datasets.video_files import write_h264

    os.makedirs(CACHE, exist_ok=True)
    width, height = map(int, args.size.split("x"))
    print(
        f"tiny3d width {args.width} at {args.img}x{args.img} on {args.device}; chunk {args.chunk} overlap "
        f"{args.overlap}; H.264 {width}x{height}; features float16; the fastest of {args.repeat} runs"
    )
    print(
        f"{'frames':>7s} {'chunks':>6s} | {'features: chunks/s':>18s} {'peak RSS':>9s} | {'classify: chunks/s':>18s} "
        f"{'peak RSS':>9s} | {'speed features/classify':>23s}"
    )
    rss = []
    for length in [int(n) for n in args.lengths.split(",")]:
        video = write_h264(os.path.join(CACHE, f"h264_{width}x{height}_{length}.mp4"), length, width, height)
        features, plain = run_interleaved(video, ("features", "full"), args)
        rss.append(features["peak_rss_mb"])
        speed = [r["chunks"] / r["wall_s"] for r in (features, plain)]
        print(
            f"{length:7d} {features['chunks']:6d} | {speed[0]:18.1f} {features['peak_rss_mb']:7.0f}MB | "
            f"{speed[1]:18.1f} {plain['peak_rss_mb']:7.0f}MB | {speed[0] / speed[1]:22.3f}x"
        )
    print(f"feature extraction's peak RSS, longest vs shortest video: {rss[-1] / rss[0]:.3f}x")


if __name__ == "__main__":
    main()
