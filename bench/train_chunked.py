"""Chunked training benchmark: the memory and time of one training step as the clip grows, whole clip vs chunks.

    python -m bench.train_chunked                                 # tiny3d width 32, 64x64, T = 64 ... 1,024
    python -m bench.train_chunked --backbone r3d_18 --size 112 --frames 64,128 --chunks 16
    python -m bench.train_chunked --temporal-head transformer      # with the temporal head over the chunks

One training step (forward, backward, AdamW step) of the project's training forward (``ChunkedTrainingForward``,
the one train.py uses) on a clip of T frames, batch 1, fp32, each cell in a fresh process. Memory: on the CPU
the growth of the process's resident memory during the second step (the kernel's high-water mark, reset just
before it through /proc/self/clear_refs, minus the resident memory before it: model, optimizer state and the
uint8 clip are already there; allocations above 64 KB are mapped and unmapped one by one so resident memory
follows the live tensors); on CUDA the peak allocated device memory of the second step minus what was allocated
before it.
Time: the fastest of --repeat further steps, per clip frame, in a second process with the usual allocator. Printed as ratios: memory against T = 64 of the
same mode, time per frame against the whole-clip step at the same T.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.worker import parse_or_measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 2 ** 20



def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(args) -> dict:
    import torch

    from config import load_config
    from datasets.device_input import InputPreparer
    from engine.chunking import ChunkedTrainingForward, ChunkSpec, aggregate_chunk_logits
    from models import build_model

    torch.manual_seed(0)
    device = torch.device(args.device)
    cfg = load_config(None, [f"model.backbone={args.backbone}", f"model.width={args.width}",
                             f"model.temporal_head={args.temporal_head}", f"model.temporal_width={args.temporal_width}"])
    model = build_model(cfg.model, num_classes=10).to(device).train()
    prepare = InputPreparer(device, cfg.data.mean, cfg.data.std)
    forward = ChunkedTrainingForward(model, prepare.normalize)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clip = {"video": torch.randint(0, 255, (1, 3, args.length, args.size, args.size), dtype=torch.uint8)}
    inputs = prepare.transfer(clip)
    labels = torch.tensor([3], device=device)
    spec = ChunkSpec(args.chunk, args.overlap)

    def step():
        outputs = forward(inputs, spec)  # a temporal head's {"clip", "chunks"}, else chunk logits
        logits = outputs["clip"] if isinstance(outputs, dict) else aggregate_chunk_logits(outputs, "mean")
        loss = torch.nn.functional.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    step()  # the optimizer state, the CPU's thread pools and cuDNN's algorithm search arrive in the first step
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _status_kb("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident size
    step()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status_kb("VmHWM") * 1024 - before
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"peak_mb": peak / MB, "step_s": min(times), "input_mb": clip["video"].numel() / MB}


def step_cell(backbone: str, width: int, size: int, length: int, chunk: int, overlap: int = 0, repeat: int = 3,
              device: str = "cpu", temporal_head: str = "none", temporal_width: int = 64) -> dict | str:
    """One cell of the table: {"peak_mb", "step_s", "input_mb"} of one training step, or the error's last line.
    Memory: every allocation above 64 KB its own mapping, returned when freed, so resident memory follows the
    live tensors (glibc would keep freed blocks of the warm-up step resident and hide the measured one); time: a
    second process with the usual allocator (mapping every block costs page faults)."""
    command = [sys.executable, "-m", "bench.train_chunked", "--worker", "--backbone", backbone, "--width", str(width),
               "--size", str(size), "--length", str(length), "--chunk", str(chunk), "--overlap", str(overlap),
               "--repeat", str(repeat), "--device", device, "--temporal-head", temporal_head,
               "--temporal-width", str(temporal_width)]
    runs = [subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
            for env in ({**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}, os.environ)]
    failed = next((r for r in runs if r.returncode != 0), None)
    if failed is not None:
        return failed.stderr.strip().splitlines()[-1]
    memory_run, time_run = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    return {**memory_run, "step_s": time_run["step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="tiny3d")
    parser.add_argument("--width", type=int, default=32, help="tiny3d's width")
    parser.add_argument("--size", type=int, default=64, help="frame height and width")
    parser.add_argument("--frames", default="64,128,256,512,1024", help="clip lengths T")
    parser.add_argument("--chunks", default="16,32", help="chunk_train_size values beside the whole clip")
    parser.add_argument("--overlap", type=int, default=0)
    parser.add_argument("--temporal-head", default="none", help="model.temporal_head: none, attention, transformer")
    parser.add_argument("--temporal-width", type=int, default=64, help="model.temporal_width")
    parser.add_argument("--repeat", type=int, default=3, help="timed steps after the measured one; the fastest kept")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    args = parse_or_measure(parser, measure, length=int, chunk=int)
    if args is None:
        return
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    frames = [int(v) for v in args.frames.split(",")]
    modes = [-1] + [int(v) for v in args.chunks.split(",")]
    memory = "device allocated" if args.device == "cuda" else "host RSS growth"
    head = "" if args.temporal_head == "none" else f", temporal head {args.temporal_head} (width {args.temporal_width})"
    print(f"{args.backbone} (width {args.width}){head} at {args.size}x{args.size}, batch 1, fp32, AdamW, on {args.device}, "
          f"{os.cpu_count()} CPUs; memory: {memory} during one step")
    results = {}
    for length in frames:  # modes interleaved per length: the shared machine's speed drifts between minutes
        for chunk in modes:
            result = step_cell(args.backbone, args.width, args.size, length, chunk, args.overlap, args.repeat,
                               args.device, args.temporal_head, args.temporal_width)
            if isinstance(result, str):
                results[length, chunk] = None
                print(f"T={length} chunk={chunk}: failed: {result}", flush=True)
            else:
                results[length, chunk] = result
    header = f"{'T':>5s} {'uint8 clip MB':>13s}"
    for chunk in modes:
        name = "whole clip" if chunk == -1 else f"chunk {chunk}"
        header += f" | {name + ': MB':>16s} {'x T=' + str(frames[0]):>7s} {'ms/frame':>8s} {'x whole':>7s}"
    print(header)
    for length in frames:
        whole = results.get((length, -1))
        first = next(r for r in (results.get((length, m)) for m in modes) if r)
        line = f"{length:>5d} {first['input_mb']:>13.1f}"
        for chunk in modes:
            r, base = results.get((length, chunk)), results.get((frames[0], chunk))
            if r is None:
                line += f" | {'failed':>16s} {'':>7s} {'':>8s} {'':>7s}"
                continue
            per_frame = 1000 * r["step_s"] / length
            ratio = f"{r['step_s'] / whole['step_s']:.2f}x" if whole else "-"
            line += (f" | {r['peak_mb']:>16.1f} {r['peak_mb'] / base['peak_mb']:>6.2f}x {per_frame:>8.2f} "
                     f"{ratio:>7s}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
