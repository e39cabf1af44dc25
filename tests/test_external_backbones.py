"""Backbones of optional packages (models/external.py): a timm image model on every frame (timm/<name>) and a
transformers video model built from a local config (hf/<dir>), and a frozen backbone (model.freeze_backbone):
they train, resume exactly, write features, load local weights and are estimated by the planner, with no network.
"""

import os

import pytest
import torch
from conftest import (
    error_lines,
    needs_packages,
    overrides,
    quickstart_config,
    run_in_process,
    run_python,
    tiny_video_transformer,
)

import train
from artifacts.checkpoint import load_checkpoint
from config import load_config
from models import build_model
from planner import project

pytestmark = needs_packages("timm", "transformers", reason="optional extras (requirements-backbones.txt)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMM = "timm/test_resnet"  # timm's own test model: 0.37 M parameters, 15 BatchNorm layers


@pytest.fixture(scope="module")
def videomae(tmp_path_factory) -> str:
    return tiny_video_transformer(tmp_path_factory.mktemp("videomae"))


quickstart = quickstart_config


def test_a_timm_model_runs_on_every_frame_and_pools_the_chunk():
    import timm

    model = build_model(quickstart(f"model.backbone={TIMM}").model, 6).eval()
    clip = torch.randn(2, 3, 4, 32, 32)
    per_frame = model.rgb.net(clip.transpose(1, 2).flatten(0, 1)).view(2, 4, -1)
    torch.testing.assert_close(model.features({"video": clip}), per_frame.mean(dim=1))
    assert model.feature_dim == timm.create_model("test_resnet", num_classes=0).num_features


def test_timm_recomputed_blocks_count_each_batch_norm_step_once():
    """timm's own gradient checkpointing recomputes a block in backward: its BatchNorm statistics move once a step, as
    without recomputation, and the gradients are the same."""
    torch.manual_seed(0)
    plain = build_model(quickstart(f"model.backbone={TIMM}").model, 6).train()
    checkpointed = build_model(quickstart(f"model.backbone={TIMM}", "model.recompute_blocks=true").model, 6)
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.train()
    clip = torch.randn(2, 3, 4, 32, 32)
    for model in (plain, checkpointed):
        model(dict(video=clip)).sum().backward()
    assert checkpointed.rgb.net.grad_checkpointing  # timm's own flag
    for (name, a), b in zip(plain.state_dict().items(), checkpointed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)  # running statistics and num_batches_tracked: 1, not 2
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_a_hf_video_model_resamples_a_chunk_to_its_frames_and_checks_the_size(videomae):
    model = build_model(quickstart(f"model.backbone=hf/{videomae}").model, 6).eval()
    assert model.rgb.frames == 4 and model.feature_dim == 32
    clip = torch.randn(1, 3, 7, 32, 32)
    expected = model.rgb(clip[:, :, [0, 2, 4, 6]])  # 7 frames to 4: nearest, evenly over the chunk
    torch.testing.assert_close(model.rgb(clip), expected)
    with pytest.raises(ValueError, match="takes 32x32 frames .* set data.img_size: 32"):
        model.rgb(torch.randn(1, 3, 4, 48, 48))


def test_a_v_jepa_2_encoder_runs_without_its_predictor(tmp_path):
    import transformers

    if not hasattr(transformers, "VJEPA2Config"):
        pytest.skip(f"transformers {transformers.__version__} has no V-JEPA 2")
    tiny_video_transformer(tmp_path, "vjepa2")
    model = build_model(quickstart(f"model.backbone=hf/{tmp_path}", "model.recompute_blocks=true").model, 6)
    assert model.rgb.frames == 4 and model.rgb.net.predictor is None
    model.train()(dict(video=torch.randn(2, 3, 8, 32, 32))).sum().backward()
    assert all(p.grad is not None for p in model.parameters())  # nothing unused: DDP would stall on one


@pytest.mark.parametrize(
    "changes",
    [
        [f"model.backbone={TIMM}"],
        [f"model.backbone={TIMM}", "model.recompute_blocks=true"],
        [f"model.backbone={TIMM}", "model.freeze_backbone=true", "train.chunk_train_size=4"],
        ["model.backbone=hf/VIDEOMAE", "model.temporal_head=transformer", "train.chunk_train_size=8"],
        ["model.backbone=hf/VIDEOMAE", "model.recompute_blocks=true"],
    ],
)
def test_the_planner_estimates_them_as_it_runs_them(changes, videomae):
    cfg = quickstart(*[c.replace("VIDEOMAE", videomae) for c in changes])
    fake = project.config_training_estimate(cfg, train.STEP, 16, 4, fake=True)
    real = project.config_training_estimate(cfg, train.STEP, 16, 4, fake=False)
    assert fake.peak == real.peak > 0
    for part in ("parameters", "optimizer_state", "inputs"):
        assert getattr(fake, part) == getattr(real, part), part


@pytest.mark.parametrize("backbone", [TIMM, "hf/VIDEOMAE"])
def test_batch_auto_takes_the_largest_batch_the_planner_fits(backbone, videomae):
    from test_memory_estimate import fit  # the planner tests' budget arithmetic

    changes = [f"model.backbone={backbone.replace('VIDEOMAE', videomae)}"]
    peaks = {b: project.config_training_estimate(quickstart(*changes), train.STEP, 16, b).peak for b in (4, 5)}
    assert fit(quickstart("data.batch_size=auto", *changes), (peaks[4] + peaks[5]) // 2) == (4, 1)


def test_a_frozen_backbone_has_no_gradients_no_optimizer_state_and_no_graph():
    cfg = quickstart(f"model.backbone={TIMM}", "model.freeze_backbone=true")
    frozen = project.config_training_estimate(cfg, train.STEP, 16, 4, fake=True)
    trained = project.config_training_estimate(quickstart(f"model.backbone={TIMM}"), train.STEP, 16, 4, fake=True)
    # the head's few KB against the backbone's MB (what is alive at the peak, in the allocator's 512-byte blocks)
    assert frozen.optimizer_state < trained.optimizer_state / 100 and frozen.gradients < trained.gradients / 100
    # its forward keeps no activation for backward: only what one layer holds at a time (15.6 MB -> 5.8 MB)
    assert frozen.activations < trained.activations / 2 and frozen.parameters == trained.parameters
    model = build_model(cfg.model, 6).train()
    assert not model.rgb.training  # its BatchNorm normalizes with the statistics it has, and keeps them


@pytest.mark.parametrize("backbone, width", [(TIMM, 96), ("hf/VIDEOMAE", 32)])
def test_a_run_trains_resumes_exactly_and_writes_features(backbone, width, synthetic_root, tmp_path, videomae):
    import train

    backbone = backbone.replace("VIDEOMAE", videomae)
    args = overrides(synthetic_root, tmp_path, f"model.backbone={backbone}", "model.recompute_blocks=true")
    assert train.main(args + ["--set", "experiment=whole"]) == 0
    whole = load_checkpoint(str(tmp_path / "whole" / "latest" / "checkpoints" / "last.pt"))
    assert train.main(args + ["--set", "experiment=parts", "--stop-after-steps", "3"]) == 0
    assert train.main(args + ["--set", "experiment=parts", "--resume", "auto"]) == 0
    parts = load_checkpoint(str(tmp_path / "parts" / "latest" / "checkpoints" / "last.pt"))
    assert parts.state.global_step == whole.state.global_step == 10
    for key, value in whole.model.items():
        torch.testing.assert_close(parts.model[key], value, rtol=0, atol=0, msg=key)
    best = str(tmp_path / "whole" / "latest" / "checkpoints" / "best.pt")
    long_video = os.path.join(synthetic_root, "long.jsonl")
    done = run_in_process(
        ["infer_chunked.py", "--checkpoint", best, "--input", long_video, "--features", str(tmp_path / "f")]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    import numpy as np

    saved = np.load(tmp_path / "f" / "long_00.npz")
    assert saved["features"].shape[1] == width  # the backbone's


def test_a_frozen_hf_backbone_trains_only_its_head(synthetic_root, tmp_path, videomae):
    import train

    args = overrides(
        synthetic_root,
        tmp_path,
        f"model.backbone=hf/{videomae}",
        "model.freeze_backbone=true",
        "model.temporal_head=transformer",
        "train.chunk_train_size=4",
    )
    assert train.main(args + ["--set", "experiment=first", "--stop-after-steps", "1"]) == 0
    assert train.main(args + ["--set", "experiment=whole"]) == 0
    first, whole = (
        load_checkpoint(str(tmp_path / run / "latest" / "checkpoints" / "last.pt")) for run in ("first", "whole")
    )
    assert whole.state.global_step == 10 and first.state.global_step == 1
    backbone = [k for k in whole.model if k.startswith("rgb.")]
    head = [k for k in whole.model if k.startswith("temporal.")]
    assert backbone and head
    for key in backbone:  # ten steps from the same start: the backbone as it was built
        torch.testing.assert_close(whole.model[key], first.model[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(whole.model[k], first.model[k]) for k in head)
    model = build_model(load_config(str(tmp_path / "whole" / "latest" / "config.yaml")).model, 6)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all(name.startswith("temporal.") for name in trained)
    assert len(whole.optimizer["state"]) == len(trained)  # state for the head's parameters alone


def test_local_weights_files_round_trip_into_a_timm_backbone(tmp_path):
    import timm
    from safetensors.torch import save_file

    source = timm.create_model("test_resnet", num_classes=10)  # a classifier's file: its head left out
    torch.save(source.state_dict(), tmp_path / "w.pth")
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    for path in (tmp_path / "w.pth", tmp_path / "w.safetensors"):
        model = build_model(quickstart(f"model.backbone={TIMM}", f"model.pretrained={path}").model, 6)
        for name, value in model.rgb.net.state_dict().items():
            torch.testing.assert_close(value, source.state_dict()[name], rtol=0, atol=0, msg=name)


def test_no_network_no_package_and_no_such_model_are_one_line_each(synthetic_root, tmp_path, monkeypatch):
    import timm

    base = overrides(synthetic_root, tmp_path, "model.pretrained=true", f"model.backbone={TIMM}")
    offline = run_python(["train.py", *base], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2 and len(error_lines(offline.stderr)) == 1, offline.stderr[-2000:]
    assert "could not get timm/test_resnet's pretrained weights" in offline.stderr
    assert "set model.pretrained: /path/to/the weights file" in offline.stderr
    unknown = run_in_process(["train.py", *overrides(synthetic_root, tmp_path, "model.backbone=timm/no_such_net")])
    assert unknown.returncode == 2 and "timm has no model 'no_such_net'" in unknown.stderr.replace(
        f"timm {timm.__version__} ", "timm "
    )
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else real(name, *a))
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match="needs the timm package, which is not installed: pip install -r"):
        load_config(None, [f"model.backbone={TIMM}"])
