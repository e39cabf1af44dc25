"""What only a GPU shows. Skipped without CUDA (CI has none); run them on a GPU machine."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import overrides

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fp16_training_with_grad_scaler_on_cuda(synthetic_root, tmp_path):
    import train
    from artifacts.checkpoint import load_checkpoint

    args = overrides(synthetic_root, tmp_path, "trainer.device=cuda", "train.max_epochs=1") + ["--use_amp"]
    assert train.main(args) == 0
    state = load_checkpoint(os.path.join(tmp_path, "e2e", "latest", "checkpoints", "last.pt"))
    assert state.config["trainer"]["precision"] == "amp"
    assert state.scaler["scale"] > 0  # the GradScaler ran and was saved
    assert all(torch.isfinite(v).all() for v in state.model.values() if v.is_floating_point())


def test_probe_memory_on_cuda_prints_measured_beside_estimated():
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            "configs/quickstart.yaml",
            "--set",
            "trainer.device=cuda",
            "--set",
            "trainer.memory_budget_gb=4",
            "--probe-memory",
            "--probe-frames",
            "16",
            "--probe-batches",
            "1,2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "measured (stages kept)" in result.stdout and "largest batch at num_frames=16" in result.stdout


@pytest.mark.parametrize("backbone", ["r3d_18", "s3d", "vgg3d"])
@pytest.mark.parametrize("precision", ["32", "16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_estimate_is_within_the_range_measured_on_a_gpu(backbone, precision, checkpointing):
    """The estimate against max_memory_allocated: 0.86-1.01x over the GPU presets on an H200 (bench/RESULTS.md,
    GPU suite); below it by what the planner does not model (not cuDNN's workspaces: without cuDNN the gap was
    as large), which SAFETY_MARGIN covers."""
    import train
    from config import load_config
    from planner import project

    cfg = load_config(
        None,
        [
            f"model.backbone={backbone}",
            "model.width=32",
            "data.img_size=112",
            f"model.recompute_blocks={str(checkpointing).lower()}",
            f"trainer.precision={precision}",
        ],
    )
    estimated = project.config_training_estimate(cfg, train.STEP, 16, 4)
    measured = project.measure_training_step_cuda(cfg, train.STEP, 16, 4)
    assert measured is not None
    ratio = estimated.peak / measured["allocated"]
    assert 0.85 <= ratio <= 1.05, f"estimate / allocated {ratio:.3f} ({estimated.peak} against {measured})"


def test_the_budget_decision_never_exceeds_the_budget():
    import train
    from config import load_config
    from planner import estimate, project

    cfg = load_config(None, ["model.backbone=r3d_18", "data.img_size=112", "trainer.precision=16"])
    budget_gb = 4
    batch, _ = project.largest_batch(cfg, train.STEP, 16, estimate.usable_bytes(budget_gb))
    assert batch >= 1
    # a 4 GB card: the allocator held to the budget less the context (uncapped on a larger card, it keeps what
    # it freed cached and reserves past what the small card would have run in)
    cap = budget_gb * 2**30 - estimate.CUDA_CONTEXT_BYTES
    measured = project.measure_training_step_cuda(cfg, train.STEP, 16, batch, cap_bytes=cap)
    assert measured is not None and measured["reserved"] <= cap


def test_chunked_inference_device_memory_does_not_grow_with_clip_length():
    from config import load_config
    from engine.inference.chunks import forward_chunked
    from models import build_model

    model = build_model(load_config(None, ["model.width=8"]).model, 5).cuda().eval()
    peaks = []
    for frames in (64, 512):
        clip = {"video": torch.randn(1, 3, frames, 64, 64)}  # on the host; chunks go to the device one by one
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            for start in range(0, frames, 32):
                forward_chunked(model, {"video": clip["video"][:, :, start : start + 32].cuda()}, 16, 4)
        peaks.append(torch.cuda.max_memory_allocated())
    assert peaks[1] <= peaks[0] * 1.1


def test_a_real_cuda_out_of_memory_error_writes_the_allocators_snapshot(tmp_path):
    """trainer.memory_snapshot: on_oom on a device: the history is recorded, a real OOM in a step (a forward that
    asks for more than the device has, once) backs off and leaves a snapshot the viewer reads."""
    import pickle

    from test_training_loop import NoBatchNorm, make_run

    from engine.training import loop, oom

    class AsksTooMuch(NoBatchNorm):
        def forward(self, inputs):
            if len(inputs["video"]) > 2:
                torch.empty(torch.cuda.get_device_properties(0).total_memory * 2, dtype=torch.uint8, device="cuda")
            return super().forward(inputs)

    run, loader = make_run(AsksTooMuch().cuda(), 4, 1, tmp_path, count=4, **{"trainer.memory_snapshot": "on_oom"})
    run.runtime = type(run.runtime)(torch.device("cuda"), "32")
    run.prepare = type(run.prepare)(torch.device("cuda"), run.cfg.data.mean, run.cfg.data.std)
    run.model.normalize = run.prepare.normalize
    oom.start_memory_history(run)
    assert run.report.memory_history is True
    loop.train_one_epoch(run, loader)
    snapshot = pickle.loads((tmp_path / "memory_snapshot.pickle").read_bytes())
    assert "segments" in snapshot and "device_traces" in snapshot
    torch.cuda.memory._record_memory_history(enabled=None)
