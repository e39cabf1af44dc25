"""The training loop's memory and safety mechanics, on the CPU with small models."""

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import overrides, run_in_process
from torch import nn
from torch.utils.data import DataLoader

import train
from artifacts.checkpoint import TrainState, load_checkpoint, restore_training
from artifacts.run_dir import RunDirectory
from config import load_config
from core import memory_monitor
from core.runtime import Runtime
from datasets.device_input import DeviceInputs
from datasets.shape import DataShape
from engine.training.chunked_forward import ChunkedTrainingForward
from engine.training.interrupt import saved_on_stop
from engine.training.oom import OutOfMemoryAdvice, OutOfMemoryError
from engine.training.run import NonFiniteLossError, TrainingRun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NoBatchNorm(nn.Module):
    """Per-sample computation only (no BatchNorm), so micro-batch size cannot change the gradient."""

    def __init__(self, oom_above: int | None = None, nan: bool = False, oom_frames_above: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv3d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)
        self.oom_above, self.nan, self.oom_frames_above = oom_above, nan, oom_frames_above
        self.batch_sizes, self.chunk_lengths = [], []

    def forward(self, inputs):
        video = inputs["video"]
        self.batch_sizes.append(len(video))
        self.chunk_lengths.append(video.shape[2])
        if self.oom_above is not None and len(video) > self.oom_above:
            raise OutOfMemoryError("CUDA out of memory (simulated)")
        if self.oom_frames_above is not None and video.shape[2] > self.oom_frames_above:
            raise OutOfMemoryError("CUDA out of memory (simulated)")
        logits = self.fc(torch.relu(self.conv(video)).mean(dim=(2, 3, 4)))
        return logits * float("nan") if self.nan else logits


def samples(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "video": torch.randint(0, 255, (3, 4, 8, 8), generator=generator, dtype=torch.uint8),
            "label": i % 3,
            "skipped": "",
        }
        for i in range(count)
    ]


def make_run(model, batch_size, accumulate, tmp_path, count=8, **cfg_changes):
    cfg = load_config(
        None,
        [
            f"train.accumulate_grad_batches={accumulate}",
            f"data.batch_size={batch_size}",
            "train.weight_decay=0",
            *[f"{k}={v}" for k, v in cfg_changes.items()],
        ],
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    runtime = Runtime(torch.device("cpu"), "32")
    os.makedirs(tmp_path / "checkpoints", exist_ok=True)
    device_inputs = DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std)
    run = TrainingRun(
        ChunkedTrainingForward(model, device_inputs.normalize),
        optimizer,
        scheduler,
        runtime.grad_scaler(),
        device_inputs,
        runtime,
        cfg,
        RunDirectory(str(tmp_path)),
        ["a", "b", "c"],
        DataShape(3),
        nn.CrossEntropyLoss(),
        TrainState(),
    )
    loader = DataLoader(samples(count), batch_size=batch_size, shuffle=False)
    return run, loader


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_accumulating_4_micro_batches_of_2_equals_one_batch_of_8(tmp_path):
    accumulated, loader = make_run(NoBatchNorm(), 2, 4, tmp_path / "a")
    train.train_one_epoch(accumulated, loader)
    whole, loader = make_run(NoBatchNorm(), 8, 1, tmp_path / "b")
    train.train_one_epoch(whole, loader)
    assert accumulated.state.global_step == whole.state.global_step == 1
    for a, b in zip(weights(accumulated.model), weights(whole.model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_last_short_group_of_an_epoch_is_stepped(tmp_path):
    accumulated, loader = make_run(NoBatchNorm(), 2, 4, tmp_path / "a", count=10)  # groups of 8 and 2 clips
    train.train_one_epoch(accumulated, loader)
    plain, loader = make_run(NoBatchNorm(), 8, 1, tmp_path / "b", count=10)  # batches of 8 and 2
    train.train_one_epoch(plain, loader)
    assert accumulated.state.global_step == plain.state.global_step == 2
    for a, b in zip(weights(accumulated.model), weights(plain.model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_effective_batch(tmp_path, caplog):
    model = NoBatchNorm(oom_above=2)
    backed_off, loader = make_run(model, 8, 1, tmp_path / "a", count=16)
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        metrics = train.train_one_epoch(backed_off, loader)
    assert backed_off.state.micro_splits == 4 and metrics["clips_per_forward"] == 2
    assert "out of memory at 8 clips per forward: now 4 per forward" in caplog.text
    assert "out of memory at 4 clips per forward: now 2 per forward" in caplog.text
    assert model.batch_sizes[-4:] == [2, 2, 2, 2]  # the second batch went straight to the kept micro-batch
    reference, loader = make_run(NoBatchNorm(), 8, 1, tmp_path / "b", count=16)
    train.train_one_epoch(reference, loader)
    assert backed_off.state.global_step == reference.state.global_step == 2
    for a, b in zip(weights(backed_off.model), weights(reference.model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_out_of_memory_at_one_clip_saves_and_gives_the_ordered_advice(tmp_path):
    run, loader = make_run(NoBatchNorm(oom_above=0), 4, 1, tmp_path)
    with pytest.raises(OutOfMemoryAdvice) as info, saved_on_stop(run):
        train.train_one_epoch(run, loader)
    message = str(info.value)
    # the back-off went 4 -> 2 -> 1 clips per forward, then chunks of 4 -> 2 -> 1 frames, before giving up
    assert message.startswith(
        f"out of memory with 1 clip per forward pass in chunks of 1 frame (the model's "
        f"shortest); saved {tmp_path}/checkpoints/last.pt. To fit, in this order: 1) smaller "
        f"frames (data.img_size=[112, 112]), 2) model.recompute_blocks: true (now false), "
        f"3) trainer.precision 16/bf16 (now 32), 4) a smaller model or preset"
    )
    saved = load_checkpoint(str(tmp_path / "checkpoints" / "last.pt"))
    assert saved.state.micro_splits == 4 and saved.state.chunk_train_size == 1


def test_the_step_raises_and_writes_nothing_the_one_save_is_saved_on_stop(tmp_path):
    run, loader = make_run(NoBatchNorm(oom_above=0), 4, 1, tmp_path)
    with pytest.raises(OutOfMemoryAdvice) as info:
        train.train_one_epoch(run, loader)
    assert os.listdir(tmp_path / "checkpoints") == [] and "saved" not in str(info.value)


def test_out_of_memory_at_one_clip_halves_the_chunk_and_resumes_with_it(tmp_path, caplog):
    model = NoBatchNorm(oom_frames_above=2)  # clips of 4 frames: only chunks of 2 fit
    backed_off, loader = make_run(model, 2, 1, tmp_path / "a", count=8)
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        metrics = train.train_one_epoch(backed_off, loader)
    assert "out of memory at 1 clip per forward in chunks of 4 frames: now chunks of 2 frames" in caplog.text
    assert backed_off.state.micro_splits == 2 and backed_off.state.chunk_train_size == 2
    assert metrics["chunk_train_size"] == 2 and set(model.chunk_lengths[-4:]) == {2}
    # the same training, configured with chunks of 2 from the start: the same weights
    reference, loader = make_run(NoBatchNorm(), 2, 1, tmp_path / "b", count=8, **{"train.chunk_train_size": 2})
    train.train_one_epoch(reference, loader)
    for a, b in zip(weights(backed_off.model), weights(reference.model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # kept in the checkpoint and restored on resume
    path = backed_off.save("last.pt")
    resumed, _ = make_run(NoBatchNorm(), 2, 1, tmp_path / "c")
    state, _ = restore_training(path, resumed.model.module, resumed.optimizer, resumed.scheduler, resumed.scaler)
    assert state.chunk_train_size == 2 and state.micro_splits == 2


def test_consecutive_non_finite_losses_stop_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "MAX_NONFINITE_STEPS", 3)
    run, loader = make_run(NoBatchNorm(nan=True), 2, 1, tmp_path)
    with pytest.raises(NonFiniteLossError) as info, saved_on_stop(run):
        train.train_one_epoch(run, loader)
    assert str(info.value).startswith("3 consecutive non-finite losses at step 3; saved ")
    assert run.state.skipped_steps == 3  # the steps with NaN gradients were not applied
    assert os.path.exists(tmp_path / "checkpoints" / "last.pt")
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


@pytest.mark.parametrize("grad_clip", ["null", "1.0"])
def test_a_step_with_an_infinite_gradient_and_a_finite_loss_is_skipped(tmp_path, grad_clip):
    """fp32 has no loss scaler to find non-finite gradients: the step checks their norm, with or without clipping."""
    run, _ = make_run(NoBatchNorm(), 2, 1, tmp_path, **{"train.grad_clip": grad_clip})
    params = list(run.model.parameters())
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    params[-1].grad[0] = float("inf")
    assert not step(run)
    assert all(torch.equal(a, b) for a, b in zip(before, params)) and all(p.grad is None for p in params)
    for p in params:
        p.grad = torch.ones_like(p)
    assert step(run)
    assert not any(torch.equal(a, b) for a, b in zip(before, params))


def step(run) -> bool:
    """train.py's optimizer step on a run's pieces."""
    return train.optimizer_step(run.model, run.optimizer, run.scaler, run.scheduler, run.max_grad_norm)


def test_leak_detector_fires_on_steady_growth_only():
    leaky = memory_monitor.LeakDetector(epochs=3, tolerance_mb=50)
    flat = memory_monitor.LeakDetector(epochs=3, tolerance_mb=50)
    messages, quiet = [], []
    for epoch in range(5):
        messages.append(leaky.observe({"host_rss_mb": 800 + 40 * epoch, "workers_rss_mb": 300, "num_workers_alive": 2}))
        quiet.append(
            flat.observe(
                {"host_rss_mb": 800 + (7 if epoch % 2 else -5), "workers_rss_mb": 300 + epoch, "num_workers_alive": 2}
            )
        )
    assert messages[:3] == [None, None, None] and "the main process (host RSS) grew 120 MB" in messages[3]
    assert "outputs or losses kept across steps" in messages[3]
    assert quiet == [None] * 5


def test_leak_detector_on_a_real_leaking_validation(synthetic_root, tmp_path, monkeypatch, caplog):
    kept = []
    real_evaluate = train.evaluate

    def leaking_evaluate(*args, **kwargs):
        kept.append(torch.ones(100 * 2**20 // 4))  # 100 MB kept per validation, like outputs kept with history
        return real_evaluate(*args, **kwargs)

    args = overrides(
        synthetic_root,
        tmp_path,
        "train.max_epochs=5",
        "data.num_workers=1",
    )
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        assert train.main(args) == 0
    assert "possible memory leak" not in caplog.text  # a clean run stays silent
    monkeypatch.setattr(train, "evaluate", leaking_evaluate)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        assert train.main(args) == 0
    # the allocated heap shows it even when the leak reuses freed, still resident memory (RSS flat)
    assert "possible memory leak: the main process (allocated host heap) grew" in caplog.text


KILLER = """
import sys, torch
from artifacts.checkpoint import Checkpoint, save_checkpoint
from datasets.shape import DataShape
ckpt = Checkpoint({{"w": torch.randn(8_000_000)}}, {{}}, ["a", "b"], DataShape(2))
save_checkpoint(ckpt, {path!r})
print("first", flush=True)
for step in range(1, 10_000):
    ckpt.state.global_step = step
    ckpt.model["w"].add_(1)
    save_checkpoint(ckpt, {path!r})
"""


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.45])
def test_kill_9_during_saves_leaves_a_loadable_last_pt(tmp_path, delay):
    path = str(tmp_path / "last.pt")
    process = subprocess.Popen(
        [sys.executable, "-c", KILLER.format(path=path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "first"
    time.sleep(delay)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    ckpt = load_checkpoint(path)
    weights, step = ckpt.model["w"], ckpt.state.global_step
    assert weights.shape == (8_000_000,)
    torch.testing.assert_close(
        weights - step, weights[:1].expand(8_000_000) - step, rtol=0, atol=10
    )  # a consistent state, not a torn one


@pytest.mark.parametrize(
    "chunks",
    [
        ["model.norm=group"],
        ["model.norm=sync", "train.chunk_train_size=4", "train.chunk_train_overlap=1", "train.precise_bn_batches=2"],
        [
            "model.norm=group",
            "train.chunk_train_size=4",
            "train.chunk_train_overlap=1",
            "model.temporal_head=transformer",
            "train.grad_chunks=2",
            "train.ddp_sync=during_backward",
            "train.accumulate_grad_batches=2",
            "trainer.memory_budget_gb=2",
        ],
    ],
    # one group run per path of the step: whole clips; training chunks (with SyncBatchNorm and precise BN, which
    # only they reach); and all of the chunked path at once: a temporal head over sampled chunk gradients, the
    # all-reduce overlapped with backward under accumulation (each parameter's gradient summed over two drawn
    # chunks and two batches before its bucket is sent)
    ids=[
        "whole-clips",
        "chunked-sync-batchnorm-precise-bn",
        "temporal-head-sampled-gradients-overlapped-accumulated",
    ],
)
def test_two_gloo_processes_match_one_process(synthetic_root, tmp_path, chunks):
    # GroupNorm and SGD: the per-sample model and the linear optimizer make one process and two comparable
    # to float rounding (BatchNorm would see 2 clips per process instead of 4; SyncBatchNorm sees the 4, and
    # precise BN pools both ranks' batches: the 8 clips of one process's 2 batches). With chunked training, every
    # chunk is recomputed in backward, and the gradients are averaged once per step. With train.grad_chunks every
    # rank draws the chunks one process draws for the whole batch.
    common = ["train.max_epochs=1", "train.optimizer=sgd", "train.lr=0.05", *chunks]
    one = run_in_process(["train.py", *overrides(synthetic_root, tmp_path / "one", *common, "data.batch_size=4")])
    assert one.returncode == 0, one.stderr
    threads = torch.get_num_threads()  # the count a CPU run's figures depend on, named where the run starts
    assert f"on cpu ({threads} compute thread{'s' if threads > 1 else ''}), precision 32" in one.stderr
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            *overrides(synthetic_root, tmp_path / "two", *common, "data.batch_size=2"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    mode = "during_backward" if "train.ddp_sync=during_backward" in chunks else "agreed"
    assert f"2 processes, train.ddp_sync: {mode}" in two.stderr
    if "trainer.memory_budget_gb=2" in chunks:  # train.recompute: auto keeps every chunk, on every rank
        # of the 3 chunks only the 2 drawn hold a graph
        assert "keeping the activations of 2 of 2 training chunks" in one.stderr + two.stderr
    accumulate = 2 if "train.accumulate_grad_batches=2" in chunks else 1
    assert f"global batch {4 * accumulate} = 2 x {accumulate} accumulated x 2 processes" in two.stdout + two.stderr
    if "model.norm=sync" in chunks:
        assert "3 BatchNorm layers synchronized over 2 processes" in two.stderr
        assert "model.norm: sync on one process: BatchNorm" in one.stderr
        assert "precise BN: running statistics of 3 BatchNorm layers recomputed over 2 batches" in two.stderr
    runs = [os.listdir(tmp_path / name / "e2e") for name in ("one", "two")]
    assert all(len([r for r in names if r != "latest"]) == 1 for names in runs)  # rank 1 wrote no run of its own
    a = load_checkpoint(str(tmp_path / "one" / "e2e" / "latest" / "checkpoints" / "last.pt"))
    b = load_checkpoint(str(tmp_path / "two" / "e2e" / "latest" / "checkpoints" / "last.pt"))
    assert a.state.global_step == b.state.global_step
    # an epoch of 48 SGD steps at lr 0.05 (updates of about 5e-3 a step): float rounding, which depends on the
    # compute threads each process has, grows along the way to about 1.3e-4 (one thread each; 2 threads in the
    # one process stayed under 1e-5); a wrong averaging or a clip counted twice moves weights by whole updates
    for key, value in a.model.items():
        torch.testing.assert_close(b.model[key], value, rtol=1e-3, atol=5e-4, msg=lambda m, key=key: f"{key}: {m}")
    assert a.state.history[0]["val_num_clips"] == b.state.history[0]["val_num_clips"] == 6  # gathered, no duplicates


def test_an_out_of_memory_step_writes_the_allocator_snapshot_when_recording(tmp_path, caplog, monkeypatch):
    """trainer.memory_snapshot: on_oom. CUDA's allocator is not on this machine: its snapshot is a stand-in
    dict; the path it takes (each OOM of a step, backed off, written atomically as the run's
    memory_snapshot.pickle and named with its viewer) is the one a CUDA run takes."""
    import pickle

    from engine.training import oom

    taken = []
    monkeypatch.setattr(oom.memory_monitor, "allocator_snapshot", lambda: taken.append(1) or {"segments": [1]})
    run, loader = make_run(NoBatchNorm(oom_above=2), 8, 1, tmp_path, count=8, **{"trainer.memory_snapshot": "on_oom"})
    with caplog.at_level(logging.INFO, logger="longvideo"):
        oom.start_memory_history(run)  # on the CPU: said once, nothing recorded
    assert "trainer.memory_snapshot: on_oom records CUDA's allocator; on cpu nothing is recorded" in caplog.text
    assert run.report.memory_history is False
    run.report.memory_history = True  # as start_memory_history leaves a CUDA run
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        train.train_one_epoch(run, loader)
    assert len(taken) == 2  # 8 -> 4 -> 2 clips per forward: two out-of-memory errors, a snapshot each
    path = tmp_path / "memory_snapshot.pickle"
    assert pickle.loads(path.read_bytes()) == {"segments": [1]}
    assert (
        f"out of memory at step 0: the allocator's snapshot is {path} (open it at https://pytorch.org/memory_viz)"
        in caplog.text
    )
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "memory_snapshot.pickle"]  # no temporary file left
