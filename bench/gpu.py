"""The GPU suite: the project's memory promises measured on a CUDA device in one call, each against the project's own
prediction. Its CPU mode (--quick) runs in make test, so the CUDA branches are exercised at every change.

    python -m bench.gpu --out DIR             # on a CUDA device
    python -m bench.gpu --out DIR --quick     # tiny shapes; on the CPU this is what make test runs
    python -m bench.gpu --out DIR --only presets,batch_auto --presets rtx5080.yaml,gtx1650.yaml

gpu.md and gpu.json are written again after each measurement, so a run stopped at a time limit keeps what it
measured.

Writes DIR/gpu.md (markdown tables; the device, driver, CUDA, torch and cuDNN versions at the top) and DIR/gpu.json
(every figure, and each failure's reason), and prints a line per measurement. A measurement that fails (an OOM, an
exception) is recorded as failed with its one-line reason, and the suite goes on.

Measurements (each a function below, the same code on both devices; they differ only where a CUDA call is made):

    cuda_tests      tests/test_cuda.py run, its pass / fail / skip counts (all skipped on the CPU)
    presets         every GPU preset (a trainer.memory_budget_gb) at its own shape, model.recompute_blocks off and
                    on: the planner's estimate against the real training step's peak (CUDA: max_memory_allocated
                    and max_memory_reserved after a warm-up step; CPU: the growth of resident memory during a step,
                    against the estimate's growth, fp32)
    chunked         the rtx5080 preset with training chunks at T = 64, 256, 1,024 (train.recompute: auto at the
                    preset's budget, the temporal head on): estimate against the real step
    batch_auto      data.batch_size: auto on each GPU preset: the batch the planner picks, whether that batch runs
                    with the allocator held to the budget less the CUDA context (set_per_process_memory_fraction:
                    a card of the budget's size on a larger one), and the headroom left under that cap
    inference       the seed guide's table: a 1,000-frame video unchunked and in chunks of 128, 64, 32 with overlap
                    0 and 8 (peak memory and time, the planner's estimate beside it); streaming 100,000 frames
                    against 600 (peak memory ratio, target <= 1.1x)
    oom_backoff     train.py on the rtx5080 preset under a memory cap half its batch fits (CUDA:
                    set_per_process_memory_fraction; CPU: the same error raised above half the batch): the batch it
                    backs off to, and whether it finishes
    throughput      the rtx5080 preset's training step: clips/s (and peak memory on CUDA) in fp32, fp16, bf16, with
                    recomputed blocks, chunked, channels_last_3d and torch.compile, against the preset as it is
    head            the temporal head's training step on features (the timeline path) over a minute and over an
                    hour of chunks (11,250), tcn and transformer: estimate against the measured step
    data_loading    one epoch of train.py on the rtx5080 preset with its workers: clips/s and the share of time
                    the step waited for data (is the GPU starved, and by how much)

With --quick the shapes are tiny (tiny3d width 8, 32x32 frames, 8 frames, batch 2; fp32 on the CPU), one preset
(rtx5080), T = 16 and 64, a 200-frame video (streaming 2,000 against 200 frames, in this process on the CPU): the
same functions, so the suite cannot rot on machines without CUDA.

Its figures from a GPU: bench/RESULTS.md, "GPU suite".
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback

import torch

import train
from bench.memory_estimate import cpu_step_growth
from config import Config, load_config
from core.cli import one_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def gpu_presets() -> list[str]:
    """The presets that state a GPU memory budget, by file name."""
    names = []
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".yaml") and load_config(os.path.join(ROOT, "configs", name)).trainer.memory_budget_gb:
            names.append(name)
    return names


class Suite:
    """Where the measurements run (``cuda``), at which shapes (``quick``), and what they found."""

    def __init__(self, quick: bool, cuda: bool, presets: list[str] | None = None):
        self.quick, self.cuda = quick, cuda
        self.chosen_presets = presets  # None: every GPU preset (--quick: rtx5080 alone)
        self.results: dict[str, dict] = {}

    def presets(self) -> list[str]:
        """The GPU presets to measure: --presets, else rtx5080 with --quick, else every one."""
        if self.chosen_presets:
            return self.chosen_presets
        return ["rtx5080.yaml"] if self.quick else gpu_presets()

    def config(self, preset: str, *changes: str) -> tuple[Config, list[str]]:
        """A preset with ``changes``, and with --quick the tiny shape: (the config, the overrides applied)."""
        tiny = ["model.backbone=tiny3d", "model.width=8", "data.img_size=32", "data.num_frames=8", "data.batch_size=2"]
        tiny = tiny + ([] if self.cuda else ["trainer.precision=32"]) if self.quick else []
        # memory does not depend on the weights: none is downloaded (the suite runs where there is no network)
        overrides = ["model.pretrained=null", *tiny, *changes]
        return load_config(os.path.join(ROOT, "configs", preset), overrides), overrides

    def step_peak(
        self, cfg: Config, preset: str, overrides: list[str], frames: int, batch: int, kept: int, cap: int | None
    ) -> dict:
        """The real training step's memory (``cfg``: ``preset`` with ``overrides``, which the CPU's fresh process
        loads again): CUDA, the allocator's peaks after a warm-up step, the allocator held to ``cap`` bytes if
        given (None if it ran out of memory); CPU, the resident growth during a step (fp32)."""
        if self.cuda:
            from planner.project import measure_training_step_cuda

            measured = measure_training_step_cuda(cfg, train.STEP, frames, batch, kept_chunks=kept, cap_bytes=cap)
            return {"oom": True} if measured is None else measured
        return {"growth": cpu_step_growth(overrides, frames, batch, os.path.join(ROOT, "configs", preset), kept)}

    def compare(
        self, preset: str, overrides: list[str], frames: int, batch: int, kept: int = 0, cap: int | None = None
    ) -> dict:
        """The planner's estimate beside the real step (``kept`` training chunks not recomputed; on CUDA the
        allocator held to ``cap`` bytes if given), and their ratio."""
        from planner.project import config_training_estimate

        cfg = load_config(os.path.join(ROOT, "configs", preset), overrides)
        estimate = config_training_estimate(cfg, train.STEP, frames, batch, kept_chunks=kept)
        measured = self.step_peak(cfg, preset, overrides, frames, batch, kept, cap)
        row = {"frames": frames, "batch": batch}
        if measured.get("oom"):
            return {**row, "estimated_mib": estimate.peak / MiB, "failed": "out of memory"}
        if self.cuda:
            return {
                **row,
                "estimated_mib": estimate.peak / MiB,
                "allocated_mib": measured["allocated"] / MiB,
                "reserved_mib": measured["reserved"] / MiB,
                "estimate_over_allocated": estimate.peak / measured["allocated"],
            }
        growth = estimate.peak - estimate.before_step
        return {
            **row,
            "estimated_growth_mib": growth / MiB,
            "measured_growth_mib": measured["growth"] / MiB,
            "estimate_over_measured": growth / measured["growth"],
            # the step's peak: what it began with (the estimate's, no allocator on the host) plus its measured growth
            "measured_peak_mib": (estimate.before_step + measured["growth"]) / MiB,
        }


# --------------------------------------------------------------------------------------------- measurements


def failure(error: BaseException) -> str:
    """An error in one line, whatever it said."""
    return " ".join((one_line(error) or type(error).__name__).split())


def attempt(measure, **row) -> dict:
    """One row: ``row`` with what ``measure()`` gives, or with its failure's reason (the other rows go on)."""
    try:
        return {**row, **measure()}
    except (Exception, SystemExit) as e:
        return {**row, "failed": failure(e)}


def cuda_tests(suite: Suite) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "tests/test_cuda.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "1000"},  # the summary cuts each reason at the terminal's width
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-200:]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    if not counts:
        raise RuntimeError(f"pytest gave no summary: {summary}")
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    # pytest -rf's short summary: "FAILED tests/test_cuda.py::name - the reason", one line a failed test
    failures = [line.removeprefix("FAILED ") for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    row = {"tests_passed": counts.get("passed", 0), "tests_failed": failed, "tests_skipped": counts.get("skipped", 0)}
    return [{**row, "failures": "; ".join(failures)} if failures else row]


# --quick on the CPU compares the estimate at this shape: a step's growth of about 10 MiB, which resident memory
# measures; the tiny shape's is under 1 MiB, within the pages the allocator happens to map
MEASURABLE_ON_THE_HOST = ("model.width=16", "data.img_size=64", "data.batch_size=4")


def presets(suite: Suite) -> list[dict]:
    rows = []
    shape = MEASURABLE_ON_THE_HOST if suite.quick and not suite.cuda else ()
    for preset in suite.presets():
        for recompute in ("false", "true"):
            cfg, overrides = suite.config(preset, f"model.recompute_blocks={recompute}", *shape)
            row = {"preset": preset, "precision": cfg.trainer.precision, "recompute_blocks": recompute}
            frames, batch = cfg.data.num_frames, cfg.data.batch_size
            rows.append(attempt(functools.partial(suite.compare, preset, overrides, frames, batch), **row))
    return rows


def chunked(suite: Suite) -> list[dict]:
    from planner.estimate import usable_bytes
    from planner.project import most_chunks_kept

    lengths, chunk = ((16, 64), 8) if suite.quick else ((64, 256, 1024), 32)
    rows = []
    for frames in lengths:
        changes = [f"train.chunk_train_size={chunk}", "model.temporal_head=transformer", f"data.num_frames={frames}"]
        cfg, overrides = suite.config("rtx5080.yaml", *changes)
        budget = cfg.trainer.memory_budget_gb
        kept = most_chunks_kept(cfg, train.STEP, frames, cfg.data.batch_size, usable_bytes(budget, suite.cuda))[0]
        row = {"chunk": chunk, "kept": kept}
        rows.append({**row, **suite.compare("rtx5080.yaml", overrides, frames, cfg.data.batch_size, kept)})
    return rows


def batch_auto(suite: Suite) -> list[dict]:
    from planner.estimate import CUDA_CONTEXT_BYTES, GiB, usable_bytes
    from planner.project import config_training_estimate, largest_batch

    rows = []
    for preset in suite.presets():
        cfg, overrides = suite.config(preset)
        budget = cfg.trainer.memory_budget_gb
        if suite.quick and not suite.cuda:  # a budget the tiny shape fills: batch 8's estimate and the margin
            budget = config_training_estimate(cfg, train.STEP, cfg.data.num_frames, 8).peak / usable_bytes(
                1, cuda=False
            )
        usable = usable_bytes(budget, suite.cuda)
        batch, _ = largest_batch(cfg, train.STEP, cfg.data.num_frames, usable, limit=64 if suite.quick else 1024)
        # CUDA: the allocator held to the budget less the context, as on a card of the budget's size
        cap = int(budget * GiB - CUDA_CONTEXT_BYTES)
        row = {"preset": preset, "budget_mib": budget * 1024, "batch": batch}
        batched = [*overrides, f"data.batch_size={batch}"]
        measured = suite.compare(preset, batched, cfg.data.num_frames, batch, cap=cap)
        peak = measured.get("reserved_mib", measured.get("measured_peak_mib"))
        headroom = None if peak is None else (cap if suite.cuda else budget * GiB) / MiB - peak
        rows.append({**row, **measured, "runs": "failed" not in measured, "headroom_mib": headroom})
    return rows


def inference(suite: Suite) -> list[dict]:
    """infer_chunked's streaming path (bench.infer's worker: decode thread, tiny3d) on a 1,000-frame video, the
    whole video in one chunk and in chunks of 128, 64, 32 with overlap 0 and 8 (peak device memory on CUDA, peak
    host RSS on the CPU; the planner's estimate of one forward beside it), then streaming 100,000 frames against
    600 (the target: at most 1.1x the peak). --quick: 200 frames, whole and in chunks of 16, 2,000 against 200."""
    from types import SimpleNamespace

    from bench.infer import CACHE, measure, run
    from bench.resident import growth_since, reset_high_water_mark
    from datasets.video_files import write_h264
    from planner.project import config_inference_estimate

    length, lengths = (200, (200, 2000)) if suite.quick else (1000, (600, 100_000))
    chunks = [(length, 0), (16, 8)] if suite.quick else [(length, 0)] + [
        (c, o) for c in (128, 64, 32) for o in (0, 8)
    ]  # fmt: skip
    img, width = (32, 8) if suite.quick else (112, 16)
    cfg = load_config(None, ["model.backbone=tiny3d", f"model.width={width}", f"data.img_size={img}"])
    os.makedirs(CACHE, exist_ok=True)

    def streamed(frames: int, chunk: int, overlap: int) -> dict:
        video = write_h264(os.path.join(CACHE, f"gpu_suite_64x48_{frames}.mp4"), frames, 64, 48)
        args = SimpleNamespace(chunk=chunk, overlap=overlap, batch=1, img=img, width=width, torch_threads=1,
                               decode_threads=1, device="cuda" if suite.cuda else "cpu", repeat=1)  # fmt: skip
        if suite.cuda or not suite.quick:  # a fresh process: its peaks are this run's alone
            result = run(video, "full", args)
            return {"peak_mib": result.get("device_peak_mb", result["peak_rss_mb"]), "s": result["wall_s"]}
        before = reset_high_water_mark()  # --quick on the CPU: in this process, its resident memory's high-water mark
        result = measure(SimpleNamespace(**vars(args), video=video, mode="full"))
        return {"peak_mib": (before + growth_since(before)) / MiB, "s": result["wall_s"]}

    rows = []
    for chunk, overlap in chunks:
        measured = streamed(length, chunk, overlap)
        estimate = config_inference_estimate(cfg, chunk, 1, num_classes=6) / MiB
        name = "unchunked" if chunk == length else f"chunk {chunk} overlap {overlap}"
        memory = "device_peak_mib" if suite.cuda else "host_peak_rss_mib"
        rows.append({"run": name, "frames": length, "estimated_mib": estimate, memory: measured["peak_mib"],
                     "seconds": measured["s"]})  # fmt: skip
    short, long = (streamed(frames, 32, 8) for frames in lengths)
    rows.append({"run": f"streaming {lengths[1]} vs {lengths[0]} frames, chunk 32 overlap 8",
                 "frames": lengths[1], "peak_ratio": long["peak_mib"] / short["peak_mib"], "seconds": long["s"]})  # fmt: skip
    return rows


def train_on_synthetic(suite: Suite, work: str, *changes: str, steps: int | None = None) -> tuple[int, str]:
    """train.py on the rtx5080 preset (the suite's shape) over a small synthetic set written to ``work``, one
    epoch (or ``steps`` steps): (its exit code, its run directory)."""
    from datasets.synthetic import generate

    size = 32 if suite.quick else 128  # decoded, then resized to the preset's img_size as any file is
    data = generate(os.path.join(work, "data"), size=size, num_train=8 if suite.quick else 48, num_val=2,
                    num_test=0, short_frames=12 if suite.quick else 48, num_long=0, num_multiview=0, quiet=True)  # fmt: skip
    _, overrides = suite.config("rtx5080.yaml", f"data.data_dir={data}", "data.val_fraction=null", *changes)
    overrides += [f"trainer.output_dir={work}", "train.max_epochs=1", "experiment=suite"]
    overrides += [] if suite.cuda else ["trainer.device=cpu"]
    args = ["--config", os.path.join(ROOT, "configs", "rtx5080.yaml")]
    args += [item for change in overrides for item in ("--set", change)]
    args += ["--stop-after-steps", str(steps)] if steps else []
    return train.main(args), os.path.join(work, "suite", "latest")


def oom_backoff(suite: Suite) -> list[dict]:
    """train.py on the rtx5080 preset under a memory cap that half its batch fits and the whole does not: on CUDA
    torch.cuda.set_per_process_memory_fraction at the planner's estimate of half the batch (a real CUDA OOM); on the
    CPU, where nothing caps memory, the same out-of-memory error raised by every forward of more clips than that.
    The run must back off and finish its steps: the batch it settled on (data.batch_size / state.micro_splits)."""
    import math
    import tempfile

    from artifacts.checkpoint import load_checkpoint
    from engine.training.oom import OutOfMemoryError
    from planner.project import config_training_estimate

    cfg, _ = suite.config("rtx5080.yaml")
    batch = cfg.data.batch_size
    fits = config_training_estimate(cfg, train.STEP, cfg.data.num_frames, batch // 2).peak
    if suite.cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(fits / total)  # the allocator's share; the context is outside
        undo = lambda: torch.cuda.set_per_process_memory_fraction(1.0)  # noqa: E731
    else:

        def cap(module, inputs):
            video = inputs[0].get("video") if inputs and isinstance(inputs[0], dict) else None
            if video is not None and len(video) > batch // 2:
                raise OutOfMemoryError("out of memory (the suite's cap on the CPU)")

        undo = torch.nn.modules.module.register_module_forward_pre_hook(cap).remove
    with tempfile.TemporaryDirectory() as work:
        try:  # in this process: the cap holds for it
            code, run = train_on_synthetic(suite, work, "data.num_workers=0", "data.sample_timeout_s=null", steps=2)
        finally:
            undo()
        state = load_checkpoint(os.path.join(run, "checkpoints", "last.pt")).state
    settled = math.ceil(batch / state.micro_splits)
    return [{"preset": "rtx5080.yaml", "batch": batch, "cap_mib": fits / MiB, "settled_batch": settled,
             "finished": code == 0 and state.global_step == 2}]  # fmt: skip


def data_loading(suite: Suite) -> list[dict]:
    """Is the GPU starved? One epoch of train.py on the rtx5080 preset with its DataLoader workers (capped to this
    machine's cores, as train.py caps them) over synthetic clips: clips/s and the share of the epoch the
    step waited for data (metrics.csv's data_time_share: 0 = never starved)."""
    import csv
    import tempfile

    cfg, _ = suite.config("rtx5080.yaml")
    with tempfile.TemporaryDirectory() as work:
        code, run = train_on_synthetic(suite, work)
        with open(os.path.join(run, "metrics.csv"), newline="") as f:
            row = list(csv.DictReader(f))[-1]
    if code != 0:
        raise RuntimeError(f"train.py exited {code}")
    return [{"preset": "rtx5080.yaml", "workers": cfg.data.num_workers, "cpus": os.cpu_count(),
             "clips_per_s": float(row["train_clips_per_s"]), "data_time_share": float(row["data_time_share"])}]  # fmt: skip


def timed_steps(suite: Suite, cfg: Config, steps: int) -> dict:
    """train.py's training step (its ``forward_backward`` and ``optimizer_step`` over ``ProjectStep``'s model, chunks,
    loss and optimizer, under the preset's precision), with trainer.channels_last_3d and trainer.compile as train.py
    applies them: clips/s over ``steps`` steps after two warm-up steps, and on CUDA the peak allocated memory."""
    from core.runtime import Runtime
    from planner.project import ProjectStep

    device = torch.device("cuda" if suite.cuda else "cpu")
    runtime, project = Runtime(device, cfg.trainer.precision), ProjectStep(cfg, train.STEP, gpu=suite.cuda)
    classifier = project.classifier().to(device).train()
    module = torch.compile(classifier) if cfg.trainer.compile else classifier
    optimizer, scaler = project.optimizer(classifier), runtime.grad_scaler()
    batch = cfg.data.batch_size
    inputs = project.inputs(cfg.data.num_frames, batch, device)

    def one() -> None:
        project.forward_backward(module, inputs, runtime, scaler, 1.0, device)
        project.optimizer_step(classifier, optimizer, scaler)

    one()
    one()
    if suite.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    if suite.cuda:
        torch.cuda.synchronize()
    result = {"clips_per_s": batch * steps / (time.perf_counter() - start)}
    if suite.cuda:
        result["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / MiB
    return result


def throughput(suite: Suite) -> list[dict]:
    """Training throughput on the rtx5080 preset: fp32, fp16 and bf16 (the preset's is fp16), gradient
    blocks recomputed on and off, chunked training on, channels_last_3d, torch.compile; each against the preset as it
    is. --quick on the CPU: fp32 and bf16 only, and no torch.compile (its compile time alone passes a minute)."""
    precisions = ("32", "bf16") if suite.quick and not suite.cuda else ("32", "16", "bf16")
    variants = [(f"precision {p}", [f"trainer.precision={p}"]) for p in precisions]
    variants += [("blocks recomputed", ["model.recompute_blocks=true"])]
    variants += [("chunked (4 chunks)", [f"train.chunk_train_size={2 if suite.quick else 10}"])]
    variants += [("channels_last_3d", ["trainer.channels_last_3d=true"])]
    if not (suite.quick and not suite.cuda):
        variants += [("torch.compile", ["trainer.compile=true"])]
    steps = 3 if suite.quick else 10
    base_cfg, _ = suite.config("rtx5080.yaml")
    base = timed_steps(suite, base_cfg, steps)
    rows = [{"variant": f"preset as it is (precision {base_cfg.trainer.precision})", **base, "x_preset": 1.0}]
    for name, changes in variants:
        cfg, _ = suite.config("rtx5080.yaml", *changes)

        def measured(cfg=cfg) -> dict:
            result = timed_steps(suite, cfg, steps)
            return {**result, "x_preset": result["clips_per_s"] / base["clips_per_s"]}

        rows.append(attempt(measured, variant=name))
    return rows


def head(suite: Suite) -> list[dict]:
    """The temporal head's training step on features (the timeline path's, configs/timelines-head.yaml: dense
    chunk labels) over a minute of video and over the longest it is meant for (an hour at 25 fps in chunks of 8:
    11,250 chunks), tcn and transformer: the planner's estimate against the measured step (CUDA: the allocator's
    peak over what was allocated before the step; CPU: bench.scale's resident growth in a fresh process). --quick:
    the transformer at 750 chunks."""
    from bench.scale import STEP_CHUNKS, measure_step

    feature_dim = 64
    heads, lengths = (("transformer",), (750,)) if suite.quick else (("tcn", "transformer"), (75, STEP_CHUNKS))
    rows = []
    for name in heads:
        for chunks in lengths:
            step = cuda_head_step(name, chunks, feature_dim) if suite.cuda else measure_step(name, chunks, feature_dim)
            rows.append({"head": name, "chunks": chunks, "estimated_mib": step["estimated"],
                         "measured_mib": step["measured"], "estimate_over_measured": step["estimated"] / step["measured"]})  # fmt: skip
    return rows


def cuda_head_step(name: str, chunks: int, feature_dim: int) -> dict:
    """bench.scale's head step on the GPU: the allocator's peak of the second step over what it began with."""
    from bench.scale import head_step_parts
    from datasets.segmentation_task import SEGMENT_CLASSES
    from planner.features import feature_training_estimate

    cfg, model, optimizer, batch, step = head_step_parts(name, chunks, feature_dim, torch.device("cuda"))
    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    estimate = feature_training_estimate(cfg, train.STEP, feature_dim, chunks, 1, len(SEGMENT_CLASSES))
    return {
        "measured": (torch.cuda.max_memory_allocated() - before) / MiB,
        "estimated": (estimate.peak - estimate.before_step) / MiB,
    }


MEASUREMENTS = {
    "cuda_tests": cuda_tests,
    "presets": presets,
    "chunked": chunked,
    "batch_auto": batch_auto,
    "inference": inference,
    "oom_backoff": oom_backoff,
    "throughput": throughput,
    "head": head,
    "data_loading": data_loading,
}


# ---------------------------------------------------------------------------------------------- the report


def versions(cuda: bool) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}
    if not cuda:
        return {"device": f"CPU ({platform.processor() or platform.machine()}), no CUDA", **info}
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:  # no nvidia-smi on the PATH
        driver = ""
    return {
        "device": torch.cuda.get_device_name(),
        "driver": driver or "unknown",
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        **info,
    }


def markdown(header: dict, results: dict) -> str:
    lines = ["# GPU suite", "", ", ".join(f"{k}: {v}" for k, v in header.items()), ""]
    for name, result in results.items():
        lines.append(f"## {name}")
        lines.append("")
        if "failed" in result:
            lines += [f"failed: {result['failed']}", ""]
            continue
        rows = result["rows"]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        for row in rows:
            lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
        lines += ["", f"{result['seconds']:.1f} s", ""]
    return "\n".join(lines)


def _cell(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="the folder gpu.md and gpu.json go to")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the CPU's test run)")
    parser.add_argument("--only", default=",".join(MEASUREMENTS), help="which measurements, comma-separated")
    parser.add_argument(
        "--presets",
        help="presets and batch_auto: these presets (comma-separated file names), not every GPU preset (a "
        "billion-parameter one's estimate takes minutes)",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.only.split(",") if name not in MEASUREMENTS]
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(MEASUREMENTS)}")
    chosen = args.presets.split(",") if args.presets else None
    for name in chosen or []:
        if not os.path.isfile(os.path.join(ROOT, "configs", name)):
            parser.error(f"--presets: {name}: no such preset in configs/ (a file name such as rtx5080.yaml)")
    suite = Suite(args.quick, torch.cuda.is_available(), chosen)
    header = versions(suite.cuda)
    print(f"GPU suite on {header['device']}{' (--quick)' if args.quick else ''}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    for name in args.only.split(","):
        start = time.perf_counter()
        try:
            suite.results[name] = {"rows": MEASUREMENTS[name](suite)}
            status = f"{len(suite.results[name]['rows'])} rows"
        except (Exception, SystemExit) as e:  # one measurement's failure is recorded; the suite goes on
            suite.results[name] = {"failed": failure(e), "trace": traceback.format_exc(limit=3)}
            status = f"failed: {suite.results[name]['failed']}"
        suite.results[name]["seconds"] = time.perf_counter() - start
        print(f"{name}: {status} ({suite.results[name]['seconds']:.1f} s)", flush=True)
        # after each measurement: a run stopped at a time limit keeps what it measured
        write_report(args.out, header, args.quick, suite.results)
    print(f"written: {os.path.join(args.out, 'gpu.md')}, gpu.json", flush=True)
    return 0


def write_report(out: str, header: dict, quick: bool, results: dict) -> None:
    """``out``/gpu.md and gpu.json, each replaced whole."""
    from core.files import atomic_write_bytes

    atomic_write_bytes(os.path.join(out, "gpu.md"), markdown(header, results).encode())
    report = {"header": header, "quick": quick, "results": results}
    atomic_write_bytes(os.path.join(out, "gpu.json"), json.dumps(report, indent=1).encode())


if __name__ == "__main__":
    sys.exit(main())
