"""Chunked training benchmark: the memory and time of one training step as the clip grows, whole clip vs chunks.

    python -m bench.train_chunked                                 # tiny3d width 32, 64x64, T = 64 ... 1,024
    python -m bench.train_chunked --backbone r3d_18 --size 112 --frames 64,128 --chunks 16
    python -m bench.train_chunked --temporal-head transformer      # with the temporal head over the chunks
    python -m bench.train_chunked --part recompute --frames 256 --chunks 32   # chunks kept vs all recomputed
    python -m bench.train_chunked --part sampled --frames 256,1024 --chunks 32   # train.grad_chunks: K vs all
    python -m bench.train_chunked --part reconstruction --frames 256,1024 --chunks 32   # the decoder's cost

One training step of train.py (its ``forward_backward`` and ``optimizer_step``, AdamW, over the training forward
``ChunkedTrainingForward``) on a clip of T frames, batch 1, fp32, each cell in a fresh process. Memory: on the CPU
the growth of the process's resident memory during the second step (the kernel's high-water mark, reset just
before it through /proc/self/clear_refs, minus the resident memory before it: model, optimizer state and the
uint8 clip are already there; allocations above 64 KB are mapped and unmapped one by one so resident memory
follows the live tensors); on CUDA the peak allocated device memory of the second step minus what was allocated
before it.
Time: the fastest of --repeat further steps, per clip frame, in a second process with the usual allocator. Printed as ratios: memory against T = 64 of the
same mode, time per frame against the whole-clip step at the same T.

``--part recompute``: the training chunks kept unrecomputed at one T and chunk size, in one run: the whole clip (the
plain step), a budget that holds every chunk's activations, one that holds half of them (the budgets are the
planner's estimates of those two steps over 1 - its safety margin, as a user would set them; the kept counts are
the planner's decisions for them), and every chunk recomputed (no budget). Time per frame against the plain step;
memory: the step's peak (the estimate of what the step began with plus the measured growth during it) beside the
planner's estimate of the peak, and the budget.

``--part sampled``: train.grad_chunks K (--grad-chunks) against every chunk's gradient at each T, in chunks of
the first --chunks, every chunk recomputed, and K = --bank-k with train.feature_bank (host; the warm-up step fills
the bank, the measured steps compute the K drawn chunks and read the others): time per frame against the plain
step at T = 64 and against every chunk at the same T; memory against every chunk.

``--part reconstruction``: the temporal head's step (--temporal-head, transformer unless set) with
``model.chunk_reconstruction`` 1 against 0, at each T in chunks of the first --chunks: its time and memory as
ratios (the loss includes the decoder's, as train.py's does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.resident import growth_since, reset_high_water_mark
from bench.worker import parse_or_measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 2**20


def measure(args) -> dict:
    import torch

    import train
    from config import load_config
    from core.runtime import Runtime
    from datasets.device_input import DeviceInputs
    from engine.training.chunked_forward import ChunkedTrainingForward, ChunkSpec
    from engine.training.motion_pretext import motion_config, objective_forward, objective_losses
    from engine.training.optim import build_optimizer
    from models import build_model

    torch.manual_seed(0)
    device = torch.device(args.device)
    cfg = load_config(
        None,
        [
            f"model.backbone={args.backbone}",
            f"model.width={args.width}",
            f"model.temporal_head={args.temporal_head}",
            f"model.chunk_reconstruction={args.reconstruction}",
            "train.lr=0.0001",
            f"train.objective={args.objective or 'labels'}",
        ],
    )
    cfg = motion_config(cfg)  # train.objective: motion's own settings
    model = build_model(cfg.model, num_classes=len(cfg.data.class_names or range(10))).to(device).train()
    device_inputs = DeviceInputs(device, cfg.data.mean, cfg.data.std)
    bank, samples = None, None
    if args.bank:  # train.feature_bank: host; the warm-up step fills it, the measured ones read it
        from datasets.windows import chunk_windows
        from engine.training.feature_bank import FeatureBank

        bank, samples = FeatureBank(1, chunk_windows(args.length, args.chunk, args.overlap), "host"), torch.tensor([0])
    forward = objective_forward(ChunkedTrainingForward(model, device_inputs.normalize, bank=bank), cfg.train.objective)
    optimizer = build_optimizer(model, cfg.train)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    runtime = Runtime(device, "32")
    scaler = runtime.grad_scaler()
    losses = objective_losses(cfg.train, torch.nn.CrossEntropyLoss())
    clip = {"video": torch.randint(0, 255, (1, 3, args.length, args.size, args.size), dtype=torch.uint8)}
    inputs = device_inputs.transfer(clip)
    piece = {"label": torch.tensor([3], device=device), "sample": samples}
    steps = iter(range(10**9))

    def step():
        spec = ChunkSpec(args.chunk, args.overlap, kept=args.kept, grad_chunks=int(args.grad_chunks), draw=next(steps))
        train.forward_backward(forward, inputs, piece, spec, losses, runtime, scaler, 1.0)
        train.optimizer_step(model, optimizer, scaler, schedule, None)

    cuda = device.type == "cuda"
    step()  # the optimizer state, the CPU's thread pools and cuDNN's algorithm search arrive in the first step
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = reset_high_water_mark()
    step()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = growth_since(before)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"peak_mb": peak / MB, "step_s": min(times), "input_mb": clip["video"].numel() / MB}


def step_cell(
    backbone: str,
    width: int,
    size: int,
    length: int,
    chunk: int,
    overlap: int = 0,
    repeat: int = 3,
    device: str = "cpu",
    temporal_head: str = "none",
    kept: int = 0,
    grad_chunks: int = 0,
    bank: bool = False,
    reconstruction: float = 1.0,
    objective: str = "labels",
) -> dict | str:
    """One cell of the table: {"peak_mb", "step_s", "input_mb"} of one training step, or the error's last line.
    Memory: every allocation above 64 KB its own mapping, returned when freed, so resident memory follows the
    live tensors (glibc would keep freed blocks of the warm-up step resident and hide the measured one); time: a
    second process with the usual allocator (mapping every block costs page faults)."""
    command = [
        sys.executable,
        "-m",
        "bench.train_chunked",
        "--worker",
        "--backbone",
        backbone,
        "--width",
        str(width),
        "--size",
        str(size),
        "--length",
        str(length),
        "--chunk",
        str(chunk),
        "--overlap",
        str(overlap),
        "--repeat",
        str(repeat),
        "--device",
        device,
        "--temporal-head",
        temporal_head,
        "--kept",
        str(kept),
        "--grad-chunks",
        str(grad_chunks),
        "--bank",
        str(int(bank)),
        "--reconstruction",
        str(reconstruction),
        "--objective",
        objective,
    ]
    runs = [
        subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
        for env in ({**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}, os.environ)
    ]
    failed = next((r for r in runs if r.returncode != 0), None)
    if failed is not None:
        return failed.stderr.strip().splitlines()[-1]
    memory_run, time_run = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    return {**memory_run, "step_s": time_run["step_s"]}


def cell_of(args, length: int, chunk: int, **changes) -> dict | str:
    """``step_cell`` at the command line's model, size, overlap, repeats and device."""
    return step_cell(
        args.backbone,
        args.width,
        args.size,
        length,
        chunk,
        args.overlap,
        args.repeat,
        args.device,
        args.temporal_head,
        **changes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default="tiny3d")
    parser.add_argument("--width", type=int, default=32, help="tiny3d's width")
    parser.add_argument("--size", type=int, default=64, help="frame height and width")
    parser.add_argument("--frames", default="64,128,256,512,1024", help="clip lengths T")
    parser.add_argument("--chunks", default="16,32", help="chunk_train_size values beside the whole clip")
    parser.add_argument("--overlap", type=int, default=0)
    parser.add_argument("--temporal-head", default="none", help="model.temporal_head: none, attention, transformer")
    parser.add_argument("--repeat", type=int, default=3, help="timed steps after the measured one; the fastest kept")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--part",
        choices=("growth", "recompute", "sampled", "reconstruction"),
        default="growth",
        help="growth: memory and time as the clip grows; recompute: training chunks kept against all recomputed; "
        "sampled: train.grad_chunks K against every chunk; reconstruction: model.chunk_reconstruction 1 against 0",
    )
    parser.add_argument("--grad-chunks", default="2,4,8", help="--part sampled: the K values (train.grad_chunks)")
    parser.add_argument(
        "--bank-k", type=int, default=4, help="--part sampled: K of the row with train.feature_bank (host)"
    )
    args = parse_or_measure(
        parser, measure, length=int, chunk=int, kept=int, bank=int, reconstruction=float, objective=str
    )
    if args is None:
        return
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.part == "recompute":
        recompute_table(args)
        return
    if args.part == "sampled":
        sampled_table(args)
        return
    if args.part == "reconstruction":
        reconstruction_table(args)
        return
    frames = [int(v) for v in args.frames.split(",")]
    modes = [-1] + [int(v) for v in args.chunks.split(",")]
    memory = "device allocated" if args.device == "cuda" else "host RSS growth"
    head = "" if args.temporal_head == "none" else f", temporal head {args.temporal_head}"
    print(
        f"{args.backbone} (width {args.width}){head} at {args.size}x{args.size}, batch 1, fp32, AdamW, on {args.device}, "
        f"{os.cpu_count()} CPUs; memory: {memory} during one step"
    )
    results = {}
    for length in frames:  # modes interleaved per length: the shared machine's speed drifts between minutes
        for chunk in modes:
            result = cell_of(args, length, chunk)
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
            line += f" | {r['peak_mb']:>16.1f} {r['peak_mb'] / base['peak_mb']:>6.2f}x {per_frame:>8.2f} {ratio:>7s}"
        print(line, flush=True)


def recompute_table(args) -> None:
    """The training chunks kept by a budget holding every chunk, half of them, and none, against the plain step."""
    import train
    from config import load_config
    from planner.estimate import SAFETY_MARGIN
    from planner.project import config_training_estimate, graph_chunk_count, most_chunks_kept

    length, chunk = int(args.frames.split(",")[0]), int(args.chunks.split(",")[0])
    common = [
        f"model.backbone={args.backbone}",
        f"model.width={args.width}",
        f"model.temporal_head={args.temporal_head}",
        f"data.img_size={args.size}",
        f"data.num_frames={length}",
        "data.batch_size=1",
    ]
    cfg = load_config(None, [*common, f"train.chunk_train_size={chunk}", f"train.chunk_train_overlap={args.overlap}"])
    plain = config_training_estimate(load_config(None, common), train.STEP, length, 1)
    chunks = graph_chunk_count(cfg, length)
    estimates = {
        k: config_training_estimate(cfg, train.STEP, length, 1, kept_chunks=k) for k in (0, chunks // 2, chunks)
    }
    rows = [("whole clip (plain step)", -1, 0, None)]
    for name, held in (("budget holds every chunk", chunks), ("budget holds half", chunks // 2)):
        usable = estimates[held].peak  # the budget a user would set: this, with the planner's margin on top
        kept = most_chunks_kept(cfg, train.STEP, length, 1, usable)[0]
        rows.append((name, chunk, kept, usable / (1 - SAFETY_MARGIN)))
    rows.append(("no budget (every chunk recomputed)", chunk, 0, None))
    print(
        f"{args.backbone} (width {args.width}) at {args.size}x{args.size}, T={length}, training chunks of {chunk} "
        f"({chunks} chunks), batch 1, fp32, AdamW, on {args.device}, {os.cpu_count()} CPUs"
    )
    results = [cell_of(args, length, size, kept=kept) for _, size, kept, _ in rows]
    whole = results[0]
    print(
        f"{'training chunks':<34s} {'kept':>6s} {'ms/frame':>8s} {'x plain':>7s} {'measured MB':>11s} "
        f"{'estimated MB':>12s} {'budget MB':>9s}"
    )
    for (name, size, kept, budget), result in zip(rows, results):
        if isinstance(result, str):
            print(f"{name:<34s} failed: {result}")
            continue
        estimate = (
            plain
            if size == -1
            else (estimates.get(kept) or config_training_estimate(cfg, train.STEP, length, 1, kept_chunks=kept))
        )
        kept_text = "-" if size == -1 else f"{kept}/{chunks}"
        budget_text = "-" if budget is None else f"{budget / MB:.1f}"
        measured = estimate.before_step / MB + result["peak_mb"]  # what the step began with, plus its growth
        print(
            f"{name:<34s} {kept_text:>6s} {1000 * result['step_s'] / length:>8.2f} "
            f"{result['step_s'] / whole['step_s']:>6.2f}x {measured:>11.1f} {estimate.peak / MB:>12.1f} "
            f"{budget_text:>9s}",
            flush=True,
        )


def sampled_table(args) -> None:
    """train.grad_chunks: the gradient through K chunks of the clip against every chunk's, at each T of --frames
    in chunks of the first --chunks, with the plain step at T = 64 as the baseline of time per frame."""
    frames = [int(v) for v in args.frames.split(",")]
    chunk = int(args.chunks.split(",")[0])
    samples = [int(k) for k in args.grad_chunks.split(",")]
    head = "" if args.temporal_head == "none" else f", temporal head {args.temporal_head}"
    memory = "device allocated" if args.device == "cuda" else "host RSS growth"
    print(
        f"{args.backbone} (width {args.width}){head} at {args.size}x{args.size}, training chunks of {chunk}, batch 1, "
        f"fp32, AdamW, every chunk recomputed, on {args.device}, {os.cpu_count()} CPUs; memory: {memory} during one "
        f"step",
        flush=True,
    )

    def cell(length: int, size: int, grad_chunks: int = 0, bank: bool = False):
        result = cell_of(args, length, size, grad_chunks=grad_chunks, bank=bank)
        if isinstance(result, str):
            print(f"T={length} chunk={size} grad_chunks={grad_chunks or 'all'}: failed: {result}", flush=True)
            return None
        return result

    plain = cell(64, -1)
    if plain is None:
        return
    plain_per_frame = plain["step_s"] / 64
    print(
        f"{'T':>5s} {'train.grad_chunks':<18s} {'ms/frame':>8s} {'x plain T=64':>12s} {'x all':>6s} "
        f"{'MB':>8s} {'x all':>6s}"
    )
    print(
        f"{64:>5d} {'(plain, one chunk)':<18s} {1000 * plain_per_frame:>8.2f} {1.0:>11.2f}x {'-':>6s} "
        f"{plain['peak_mb']:>8.1f} {'-':>6s}",
        flush=True,
    )
    for length in frames:
        every = cell(length, chunk)
        rows = [("all", every)] + [(str(k), cell(length, chunk, k)) for k in samples]
        rows.append((f"{args.bank_k} + bank", cell(length, chunk, args.bank_k, bank=True)))
        for name, result in rows:
            if result is None:
                print(f"{length:>5d} {name:<18s} failed", flush=True)
                continue
            per_frame = result["step_s"] / length
            time_ratio = f"{result['step_s'] / every['step_s']:.2f}x" if every else "-"
            memory_ratio = f"{result['peak_mb'] / every['peak_mb']:.2f}x" if every else "-"
            print(
                f"{length:>5d} {name:<18s} {1000 * per_frame:>8.2f} {per_frame / plain_per_frame:>11.2f}x "
                f"{time_ratio:>6s} {result['peak_mb']:>8.1f} {memory_ratio:>6s}",
                flush=True,
            )


def reconstruction_table(args) -> None:
    """model.chunk_reconstruction: the temporal head's step with it at 1 against 0, at each T."""
    args.temporal_head = "transformer" if args.temporal_head == "none" else args.temporal_head
    frames = [int(v) for v in args.frames.split(",")]
    chunk = int(args.chunks.split(",")[0])
    memory = "device allocated" if args.device == "cuda" else "host RSS growth"
    print(
        f"{args.backbone} (width {args.width}), temporal head {args.temporal_head} at "
        f"{args.size}x{args.size}, training chunks of {chunk}, batch 1, fp32, AdamW, on {args.device}, "
        f"{os.cpu_count()} CPUs; memory: {memory} during one step",
        flush=True,
    )
    print(f"{'T':>5s} {'reconstruction':<15s} {'ms/frame':>8s} {'x without':>9s} {'MB':>8s} {'x without':>9s}")
    for length in frames:  # the two interleaved per length: the shared machine's speed drifts between minutes
        without, with_loss = (cell_of(args, length, chunk, reconstruction=w) for w in (0.0, 1.0))
        for name, result in (("0 (none)", without), ("1", with_loss)):
            if isinstance(result, str):
                print(f"{length:>5d} {name:<15s} failed: {result}", flush=True)
                continue
            ratios = ("-", "-")
            if not isinstance(without, str):
                ratios = (
                    f"{result['step_s'] / without['step_s']:.2f}x",
                    f"{result['peak_mb'] / without['peak_mb']:.2f}x",
                )
            print(
                f"{length:>5d} {name:<15s} {1000 * result['step_s'] / length:>8.2f} {ratios[0]:>9s} "
                f"{result['peak_mb']:>8.1f} {ratios[1]:>9s}",
                flush=True,
            )


if __name__ == "__main__":
    main()
