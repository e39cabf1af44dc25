"""The memory estimator: exact on a hand-computed model, equal to a real CPU step under the same tracker, the
right direction and size for checkpointing, precision and chunking, and the budget decisions built on it."""

import math
import os

import pytest
import torch
from conftest import run_in_process
from torch import nn

import train
from config import ConfigError, derive, load_config
from core.runtime import Runtime
from datasets.shape import DataShape
from planner import estimate as me
from planner import project
from planner.batch_size import batch_for_budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB = 1024


def plain_step(loss):
    """The loop's two calls (forward_backward, optimizer_step) for a model whose loss is ``loss(model, inputs)``."""

    def forward_backward(model, inputs, runtime, scaler, weight):
        with runtime.autocast():
            value = loss(model, inputs)
        scaler.scale(value if weight == 1 else value * weight).backward()

    def optimizer_step(model, optimizer, scaler):
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return forward_backward, optimizer_step


def conv_stack():
    return nn.Sequential(nn.Conv3d(3, 8, 1, bias=False), nn.Conv3d(8, 8, 1, bias=False))


@pytest.mark.parametrize("fake", [True, False])
def test_a_stack_of_two_convolutions_gives_the_peak_computed_by_hand(fake):
    """Input [1, 3, 4, 8, 8] fp32 = 3,072 B; both conv outputs [1, 8, 4, 8, 8] = 8,192 B; each weight (96 and
    256 B), the loss and its seed gradient take one 512-byte block; AdamW keeps 2 states per weight.
    The peak is in backward at the second conv: parameters 1,024 + optimizer state 2,048 + input 3,072 + the
    first conv's output (saved) 8,192 + the loss 512 + its seed 512 + the gradient of that output 8,192 + the
    second weight's gradient 512 = 24,064 B (the second output, 8,192 B, was freed after the forward)."""
    estimate = me.estimate_training_step(
        conv_stack,
        lambda: {"x": torch.zeros(1, 3, 4, 8, 8)},
        lambda model: torch.optim.AdamW(model.parameters()),
        *plain_step(lambda model, inputs: model(inputs["x"]).sum()),
        fake=fake,
    )
    assert estimate == me.StepEstimate(
        peak=24064,
        parameters=1024,
        gradients=512,
        optimizer_state=2048,
        inputs=3072,
        activations=8192 + 512 + 512 + 8192,
        before_step=6144,
    )


def test_a_storage_born_after_the_peak_is_not_counted_at_it_where_it_takes_a_freed_ones_id():
    """Python reuses a freed object's id at once: a gradient made after the peak in the place of a storage freed
    after it was once counted as alive at the peak (the breakdown's gradients over and activations under, the
    peak itself right), as a run of the hand-computed stack above showed after other tests."""
    tracker = me.LiveBytes()
    first = torch.zeros(1024)
    first_serial = tracker.serial(first)  # 4,096 B: the peak
    freed_id = id(first.untyped_storage())
    del first
    later = None
    for _ in range(1000):
        later = torch.zeros(8)
        if id(later.untyped_storage()) == freed_id:
            break
    else:
        pytest.skip("no storage took the freed one's id in 1,000 tries")
    later_serial = tracker.serial(later)
    assert later_serial != first_serial
    assert tracker.peak == 4096 and tracker.bytes_at_peak({later_serial}) == 0
    assert tracker.bytes_at_peak({first_serial}) == 4096


def quickstart(*changes):
    return load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), ["trainer.memory_budget_gb=1", *changes])


@pytest.mark.parametrize(
    "changes",
    [
        [],
        ["model.recompute_blocks=true"],
        ["train.chunk_train_size=4", "train.chunk_train_overlap=1"],
        ["model.input_type=rgb_kpt", "data.load_kpt=true"],
        ["model.view_fusion=mean"],
        ["train.optimizer=sgd", "train.accumulate_grad_batches=2"],
        ["model.norm=group"],
        ["model.norm=frozen", "model.pretrained=w.pt"],
    ],
)
def test_the_fake_step_equals_the_real_cpu_step_under_the_same_tracker(changes):
    cfg = quickstart(*changes)
    views = 2 if "model.view_fusion=mean" in changes else 1
    shape = {"num_views": views, "kpt_shape": (5, 2) if "data.load_kpt=true" in changes else None}
    fake = project.config_training_estimate(cfg, train.STEP, 16, 4, fake=True, **shape)
    real = project.config_training_estimate(cfg, train.STEP, 16, 4, fake=False, **shape)
    assert fake.peak == real.peak > 0
    # what was alive at the peak: the same, but gradients and activations may trade a few blocks (autograd
    # copies a gradient where a reference to it is still held, and steals it where none is)
    for part in ("parameters", "optimizer_state", "inputs"):
        assert getattr(fake, part) == getattr(real, part), part


def test_checkpointing_per_block_and_half_precision_shrink_the_activations():
    cfg = load_config(None, ["model.backbone=r3d_18", "data.img_size=112", "data.num_frames=16"])
    plain = project.config_training_estimate(cfg, train.STEP, 16, 4, precision="32")
    ckpt = project.config_training_estimate(
        derive(cfg, {"model.recompute_blocks": True}, "a test"), train.STEP, 16, 4, precision="32"
    )
    half = project.config_training_estimate(cfg, train.STEP, 16, 4, precision="16")
    # the same parameters, gradients and optimizer state: only what the step keeps changes
    assert plain.parameters == ckpt.parameters == half.parameters and plain.optimizer_state == half.optimizer_state
    assert 0.4 < ckpt.activations / plain.activations < 0.75
    assert 0.45 < half.activations / plain.activations < 0.6  # fp16 activations, a few fp32 ones (the loss)


def test_the_estimate_knows_each_norm_mode():
    cfg = load_config(None, ["model.backbone=r3d_18", "data.img_size=112", "data.num_frames=16"])
    batch = project.config_training_estimate(cfg, train.STEP, 16, 2, precision="16")
    group = project.config_training_estimate(
        derive(cfg, {"model.norm": "group"}, "a test"), train.STEP, 16, 2, precision="16"
    )
    # CUDA's autocast runs group_norm in fp32 (batch_norm in its input's fp16): more activations kept
    assert group.peak > 1.2 * batch.peak and group.parameters < batch.parameters  # (no running statistics)
    frozen = load_config(
        None,
        [
            "model.backbone=r3d_18",
            "data.img_size=112",
            "data.num_frames=16",
            "model.norm=frozen",
            "model.pretrained=w.pt",
        ],
    )
    fixed = project.config_training_estimate(frozen, train.STEP, 16, 2, precision="16")
    # the same parameters and AdamW state (the scales and shifts train); the statistics of each micro-batch are not
    # computed, so fewer activations are kept
    assert fixed.parameters == batch.parameters and fixed.optimizer_state == batch.optimizer_state
    assert fixed.activations < batch.activations


def test_chunked_training_estimate_does_not_grow_with_the_clip():
    cfg = quickstart("train.chunk_train_size=16")
    short, long = (project.config_training_estimate(cfg, train.STEP, frames, 1) for frames in (64, 512))
    assert long.inputs == 8 * short.inputs - 7 * 512  # the uint8 clip itself grows (each rounded to 512 B)
    assert long.peak - long.inputs < 1.05 * (short.peak - short.inputs)  # and nothing else
    whole = project.config_training_estimate(quickstart(), train.STEP, 512, 1)
    assert whole.peak - whole.inputs > 5 * (long.peak - long.inputs)


def test_cuda_autocast_policy_is_emulated_on_cpu_tensors():
    conv, bn = nn.Conv3d(3, 4, 3), nn.BatchNorm3d(4)
    with me.CudaAutocast(torch.float16):
        out = conv(torch.zeros(1, 3, 4, 8, 8))
        normed = bn(out)
        probabilities = normed.mean(dim=(2, 3, 4)).softmax(-1)
        loss = nn.functional.cross_entropy(normed.mean(dim=(2, 3, 4)), torch.tensor([1]))
    assert out.dtype == torch.float16 and normed.dtype == torch.float16  # conv cast; batch_norm as its input
    assert probabilities.dtype == torch.float32 and loss.dtype == torch.float32  # softmax, losses in fp32


def fit(cfg, budget_bytes, world_size=1):
    cfg.trainer.memory_budget_gb = budget_bytes / (1 - me.SAFETY_MARGIN) / me.GiB
    fitted = batch_for_budget(cfg, Runtime(torch.device("cpu"), "32", 0, world_size), DataShape(6), train.STEP)
    return fitted.data.batch_size, fitted.train.accumulate_grad_batches


def test_auto_batch_takes_the_largest_that_fits_and_keeps_the_global_batch():
    cfg = quickstart()
    peaks = {b: project.config_training_estimate(cfg, train.STEP, 16, b).peak for b in (4, 5)}
    between = (peaks[4] + peaks[5]) // 2  # 4 clips fit, 5 do not
    assert fit(quickstart("data.batch_size=auto"), between) == (4, 1)  # no global batch: accumulation as written
    assert fit(quickstart("data.batch_size=auto", "train.global_batch_size=16"), between) == (4, 4)
    assert fit(quickstart("data.batch_size=auto", "train.global_batch_size=12"), between) == (4, 3)
    assert fit(quickstart("data.batch_size=auto", "train.global_batch_size=10"), between) == (2, 5)  # a divisor
    assert fit(quickstart("data.batch_size=16", "train.accumulate_grad_batches=2"), between) == (4, 8)  # 32 kept
    assert fit(quickstart("data.batch_size=auto", "train.global_batch_size=16"), between, world_size=2) == (4, 2)


def grown_peak(kind: int, base: int, per_clip: int, block: int, power: float, jump: int):
    """A step's peak over the batch as it might grow: affine, rounded up to allocator blocks, super-linear, or
    affine with a jump (a layout that changes at one batch)."""
    if kind == 0:
        return lambda n: base + per_clip * n
    if kind == 1:
        return lambda n: math.ceil((base + per_clip * n) / block) * block
    if kind == 2:
        return lambda n: base + per_clip * n**power
    return lambda n: base + per_clip * n + (10 * per_clip if n >= jump else 0)


def test_the_largest_batch_search_is_exact_and_follows_the_line_where_the_peak_is_affine():
    """The planner's search (planner/project.py, _largest) against every batch tried in turn, on each kind of
    grown_peak, limits from 0 to 1024. Where the peak is affine it takes 4 estimates (doubling then bisection took
    12 for rtx5080's 39)."""
    generator = torch.Generator().manual_seed(0)

    def draw(low, high):
        return int(torch.randint(low, high, (1,), generator=generator))

    for case in range(400):
        base, per_clip = draw(10**5, 10**9), draw(10**3, 10**8)
        kind, limit = case % 4, [0, 1, 2, 64, 1024][case // 4 % 5]
        grows = grown_peak(kind, base, per_clip, draw(1, 21) * 2**20, 1 + draw(0, 150) / 100, draw(1, 2000))
        usable = base + per_clip * draw(0, 1500)
        asked = []

        def peak(n, asked=asked, grows=grows):
            asked.append(n)
            return grows(n)

        found = project._largest(peak, usable, limit)
        assert found == max((n for n in range(1, limit + 1) if grows(n) <= usable), default=0), (case, asked)
        assert len(asked) <= 1 + project.LINE_TRIES + math.ceil(math.log2(limit + 1)), (case, asked)
        if kind == 0:
            assert len(asked) <= 4, (case, asked)


def test_when_nothing_fits_the_error_names_each_switch_with_its_estimate():
    cfg = quickstart("data.batch_size=auto", "data.num_frames=64")
    one_clip = project.config_training_estimate(cfg, train.STEP, 64, 1).peak
    with pytest.raises(ConfigError) as info:
        fit(cfg, one_clip - 64 * KiB)
    message = str(info.value)
    assert message.startswith(
        f"data.batch_size: even 1 clip of 64 frames at 32x32 is estimated at {one_clip / me.GiB:.2f} GiB, over the "
    )
    for switch in (
        "model.recompute_blocks: true",
        "train.chunk_train_size: 16 ",
        "data.num_frames: 32 ",
        "data.img_size: [24, 24] ",
    ):
        assert switch in message
    assert "train.chunk_train_size: 16 0.00 GiB (fits)" in message or "(fits)" in message.split("chunk_train_size")[1]


def test_auto_batch_trains_and_writes_the_decision_into_the_run_config(synthetic_root, tmp_path, caplog):
    import yaml
    from conftest import overrides

    args = overrides(
        synthetic_root, tmp_path, "data.batch_size=auto", "trainer.memory_budget_gb=0.05", "train.global_batch_size=4"
    ) + ["--stop-after-steps", "1"]
    with caplog.at_level("INFO", logger="longvideo"):
        assert train.main(args) == 0
    with open(os.path.join(tmp_path, "e2e", "latest", "config.yaml")) as f:
        resolved = yaml.safe_load(f)
    batch, accumulate = resolved["data"]["batch_size"], resolved["train"]["accumulate_grad_batches"]
    assert isinstance(batch, int) and batch * accumulate == 4
    assert f"memory budget: batch {batch} x {accumulate} accumulated x 1 processes" in caplog.text


def test_batch_auto_without_a_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="data.batch_size: auto needs trainer.memory_budget_gb"):
        load_config(None, ["data.batch_size=auto"])


def test_probe_memory_prints_the_estimated_grid_without_a_gpu():
    result = run_in_process(
        [
            "train.py",
            "--config",
            "configs/quickstart.yaml",
            "--set",
            "trainer.memory_budget_gb=0.5",
            "--probe-memory",
            "--probe-frames",
            "8,16",
            "--probe-batches",
            "1,4",
        ],
    )
    assert result.returncode == 0, result.stderr
    assert "estimated, no GPU" in result.stdout and ", norm batch, adamw," in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(8, 1), (8, 4), (16, 1), (16, 4)]
    cfg = quickstart()
    expected = project.config_training_estimate(cfg, train.STEP, 16, 4).peak / me.MiB
    assert float(rows[-1][2]) == pytest.approx(expected, abs=0.6)  # the stages-kept column, rounded to MiB
    best, _ = project.largest_batch(cfg, train.STEP, 16, me.usable_bytes(0.5, cuda=False))
    assert f"that fits: {best}" in result.stdout


@pytest.mark.parametrize(
    "overrides", [[], ["model.width=64", "train.accumulate_grad_batches=2"], ["train.optimizer=sgd"]]
)
def test_several_processes_add_a_bucket_that_leaves_the_peak_unchanged(overrides):
    """Under torchrun the gradients are averaged in place through one bucket (25 MiB at most, the gradients' size
    at most) after backward, when the activations are gone: below the optimizer step's parameter-sized
    temporaries, so the estimated peak stays that of one process (a 25 MiB bucket for quickstart's 0.3 MiB of
    gradients would not)."""
    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), overrides)
    alone = project.config_training_estimate(cfg, train.STEP, 16, 4)
    several = project.config_training_estimate(cfg, train.STEP, 16, 4, world_size=2)
    assert several.peak == alone.peak and alone.gradients > 0


def test_with_overlapped_all_reduce_the_estimate_holds_ddp_buckets_of_the_gradients_size():
    """train.ddp_sync: during_backward: DistributedDataParallel's buckets, gradient-sized and alive from the start (the
    forward that makes the peak has them whole): the peak grows by about the gradients' size."""
    cfg = load_config(
        os.path.join(ROOT, "configs", "quickstart.yaml"), ["model.width=64", "train.ddp_sync=during_backward"]
    )
    alone = project.config_training_estimate(cfg, train.STEP, 16, 4)
    several = project.config_training_estimate(cfg, train.STEP, 16, 4, world_size=2)
    assert alone.gradients > 4 * me.MiB
    assert several.peak - alone.peak == pytest.approx(alone.gradients, rel=0.01)


def test_probe_memory_says_what_several_processes_hold():
    command = [
        "train.py",
        "--config",
        "configs/quickstart.yaml",
        "--probe-memory",
        "--probe-frames",
        "16",
        "--probe-batches",
        "4",
    ]
    result = run_in_process(command + ["--world-size", "2"])
    assert result.returncode == 0, result.stderr
    assert (
        "2 processes: gradients averaged in place after backward through one bucket of 0 MiB (counted above; "
        "below the peak, which it leaves unchanged); no DistributedDataParallel buckets, no second copy of the "
        "0 MiB of gradients"
    ) in result.stdout
    wrong = run_in_process(command + ["--world-size", "0"])
    assert (wrong.returncode, wrong.stderr) == (2, "error: --world-size 0: the number of processes must be 1 or more\n")


def test_infer_batch_auto_picks_the_most_chunks_that_fit(trained_run, synthetic_root):
    from artifacts.checkpoint import load_checkpoint
    from config import saved_config

    checkpoint = os.path.join(trained_run[0], "checkpoints", "best.pt")
    cfg = saved_config(load_checkpoint(checkpoint).config)
    peaks = {n: project.config_inference_estimate(cfg, 16, n, num_classes=6) for n in (5, 6)}
    assert peaks[6] > peaks[5]
    budget_gb = (peaks[5] + peaks[6]) / 2 / (1 - me.SAFETY_MARGIN) / me.GiB  # on the CPU: no CUDA context
    command = [
        "infer_chunked.py",
        "--checkpoint",
        checkpoint,
        "--input",
        os.path.join(synthetic_root, "long.jsonl"),
        "--chunk",
        "16",
        "--overlap",
        "4",
        "--max-videos",
        "1",
        "--device",
        "cpu",
        "--batch",
        "auto",
    ]
    result = run_in_process(command + ["--memory-budget-gb", repr(budget_gb)])
    assert result.returncode == 0, result.stderr
    assert "--batch auto: 5 chunks of 16 frames per forward" in result.stdout
    assert "batch 5 on cpu" in result.stdout
    no_budget = run_in_process(command)
    assert no_budget.returncode == 2
    assert no_budget.stderr.strip() == (
        "error: --batch auto needs a memory budget: --memory-budget-gb N (the "
        "checkpoint's config has no trainer.memory_budget_gb)"
    )


def test_the_loader_host_estimate_equals_a_hand_computation():
    from planner.host import DECODER_PROCESS_BYTES, loader_host_bytes

    cfg = load_config(
        None,
        [
            "data.img_size=32",
            "data.num_frames=16",
            "data.batch_size=4",
            "data.num_workers=2",
            "train.accumulate_grad_batches=2",
        ],
    )
    batch = 4 * 3 * 16 * 32 * 32  # uint8 clips
    cpu, cuda = loader_host_bytes(cfg, DataShape(6), cuda=False), loader_host_bytes(cfg, DataShape(6), cuda=True)
    assert (cpu.batch, cpu.in_flight, cpu.pinned, cpu.group) == (batch, 2 * 2 * batch, 0, 2 * batch)  # 2 ahead
    assert cpu.decoders == 2 * DECODER_PROCESS_BYTES and cuda.pinned == cuda.in_flight  # page-locked copies on CUDA
    views = loader_host_bytes(cfg, DataShape(6, num_views=3), cuda=False)
    assert views.batch == 3 * batch


def test_training_warns_when_the_loader_needs_more_host_memory_than_is_available(
    synthetic_root, tmp_path, monkeypatch, caplog
):
    from conftest import overrides

    from core import memory_monitor

    args = overrides(synthetic_root, tmp_path, "data.num_workers=0") + ["--stop-after-steps", "1"]
    monkeypatch.setattr(memory_monitor, "available_host_bytes", lambda: 40 * 2**20)  # a fake MemAvailable: 40 MB
    with caplog.at_level("WARNING", logger="longvideo"):
        assert train.main(args) == 0
    assert (
        "host memory: the training loader is estimated at 0.09 GB = 0.00 GB of batches in flight + 0.00 GB "
        "pinned copies + 0.00 GB kept for the step + 0.08 GB of decoders"
    ) in caplog.text
    assert (
        "than the 0.04 GB this machine has available; lower data.num_workers (0), data.batch_size (4) or the clip "
        "(data.num_frames 8, data.max_video_frames None)"
    ) in caplog.text
    caplog.clear()
    monkeypatch.setattr(memory_monitor, "available_host_bytes", lambda: 64 * 2**30)
    with caplog.at_level("WARNING", logger="longvideo"):
        assert train.main(args) == 0
    assert "host memory" not in caplog.text


def test_the_search_bench_names_a_preset_that_is_not_there():
    done = run_in_process(["-m", "bench.memory_estimate", "--part", "search", "--presets", "rtx5080.yaml,rtx508.yaml"])
    assert done.returncode == 2 and done.stderr.splitlines()[-1].endswith(
        "error: --presets: rtx508.yaml: no such preset in configs/ (a file name such as rtx5080.yaml)"
    ), done.stderr
    assert "(c) the largest batch" not in done.stdout  # refused before the first estimate


def test_a_slow_search_says_each_estimate_and_how_many_may_follow(monkeypatch):
    """A search whose estimates take minutes (a billion-parameter model at 1,536 frames) is not silent."""
    cfg = quickstart()
    lines = []
    usable = me.usable_bytes(0.5, cuda=False)
    monkeypatch.setattr(project, "SLOW_ESTIMATE_S", 0.0)
    best, tried = project.largest_batch(cfg, train.STEP, 16, usable, progress=lines.append)
    assert len(lines) == len(tried) and best == max(b for b, e in tried if e.peak <= usable)
    bound = 1 + project.LINE_TRIES + 11  # bisection up to 1,024: 11 more at most
    for k, (line, (batch, estimate)) in enumerate(zip(lines, tried), start=1):
        fits = "fits" if estimate.peak <= usable else "does not fit"
        assert line.startswith(f"  largest batch at num_frames=16: batch {batch} is estimated at ")
        assert f", {fits} (" in line and line.endswith(f"; at most {bound - k} estimates more)")
    monkeypatch.setattr(project, "SLOW_ESTIMATE_S", 3600.0)
    quiet = []
    assert project.largest_batch(cfg, train.STEP, 16, usable, progress=quiet.append)[0] == best and not quiet
