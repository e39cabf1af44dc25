"""model.adapter (models/adapters.py): block, side and LoRA adapters on a frozen backbone start from its outputs,
train only themselves, are estimated by the planner as they run, and a run with them trains, resumes exactly, writes
features and evaluates from checkpoints that hold the adapters and the fingerprint of the frozen weights, not them."""

import dataclasses
import os
import re

import pytest
import torch
from conftest import error_lines, needs_packages, overrides, quickstart_config, run_in_process, tiny_video_transformer

import train
from artifacts.checkpoint import load_checkpoint
from config import load_config
from models import build_model, build_rgb_backbone
from models.adapters import frozen_keys
from planner import project

pytestmark = needs_packages("transformers", "peft", reason="optional extras (requirements-backbones.txt)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("block", "side", "lora")


@pytest.fixture(scope="module")
def videomae(tmp_path_factory) -> str:
    return tiny_video_transformer(tmp_path_factory.mktemp("videomae"), layers=3)


quickstart = quickstart_config


def clip_for(backbone: str) -> torch.Tensor:
    return torch.randn(2, 3, 4, 32, 32) if backbone.startswith("hf/") else torch.randn(2, 3, 8, 32, 32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backbone", ["tiny3d", "hf/VIDEOMAE"])
def test_adapters_start_from_the_frozen_backbone_and_train_alone(kind, backbone, videomae):
    backbone = backbone.replace("VIDEOMAE", videomae)
    torch.manual_seed(0)
    frozen = build_model(quickstart(f"model.backbone={backbone}", "model.freeze_backbone=true").model, 6).train()
    torch.manual_seed(0)
    adapted = build_model(quickstart(f"model.backbone={backbone}", f"model.adapter={kind}").model, 6).train()
    clip = clip_for(backbone)
    # zero-initialized: the same features and logits as the frozen backbone's at the start
    torch.testing.assert_close(adapted(dict(video=clip)), frozen(dict(video=clip)), rtol=0, atol=1e-6)
    trained = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trained and not any(name.startswith("rgb.") and ".lora_" not in name for name in trained)
    assert (kind == "lora") == any(".lora_" in name for name in trained)
    assert adapted.backbone_without_graph == (kind == "side")
    # the gradient of block and LoRA adapters runs back through the frozen blocks: the units whose training flag
    # turns checkpointing on (the backbone, transformers' layers) keep it; what normalizes or drops stays in eval
    units = [adapted.rgb, *(m for m in adapted.rgb.modules() if hasattr(m, "gradient_checkpointing"))]
    assert all(unit.training == (kind != "side") for unit in units)
    assert not any(m.training for m in adapted.rgb.modules() if isinstance(m, (torch.nn.BatchNorm3d, torch.nn.Dropout)))
    before = {k: v.clone() for k, v in adapted.state_dict().items() if k in frozen_keys(adapted)}
    assert before and all(k.startswith("rgb.") for k in before)
    optimizer = torch.optim.SGD([p for p in adapted.parameters() if p.requires_grad], lr=1.0)
    for _ in range(2):  # the first step moves the zero output projections, the second reaches the rest
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(adapted(dict(video=clip)), torch.tensor([1, 4])).backward()
        optimizer.step()
    assert not torch.allclose(adapted.features(dict(video=clip)), frozen.features(dict(video=clip)))
    for key, value in adapted.state_dict().items():
        if key in before:  # the frozen backbone, BatchNorm statistics included, as it was
            torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)


def test_lora_updates_layers_the_forward_calls(videomae):
    """VideoMAE reads its query, key and value weights without calling their layers: LoRA there would change
    nothing. The targets are the layers a forward calls, and every one of them gets a gradient."""
    model = build_model(quickstart(f"model.backbone=hf/{videomae}", "model.adapter=lora").model, 6).train()
    adapted = {name.split(".lora_")[0] for name, _ in model.named_parameters() if ".lora_" in name}
    assert adapted and not any(name.endswith((".query", ".key", ".value")) for name in adapted)
    for module in model.modules():  # lora_B starts at zero: lora_A's gradient would be zero; give B a value
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight)
    model(dict(video=torch.randn(2, 3, 4, 32, 32))).sum().backward()
    lora = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in lora), [n for n, p in lora if p.grad is None]


def test_a_backbone_without_a_time_layout_is_refused_in_one_line():
    with pytest.raises(Exception, match="model.adapter: block: TorchvisionMViT gives no block outputs"):
        build_model(quickstart("model.backbone=mvit_v2_s", "model.adapter=block").model, 6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backbone", ["tiny3d", "hf/VIDEOMAE"])
def test_the_planner_estimates_adapters_as_it_runs_them(kind, backbone, videomae):
    changes = [
        f"model.backbone={backbone.replace('VIDEOMAE', videomae)}",
        f"model.adapter={kind}",
        "model.recompute_blocks=true",
        "model.temporal_head=transformer",
        "train.chunk_train_size=4",
    ]
    cfg = quickstart(*changes)
    fake = project.config_training_estimate(cfg, train.STEP, 16, 2, fake=True)
    real = project.config_training_estimate(cfg, train.STEP, 16, 2, fake=False)
    assert fake.peak == real.peak > 0
    for part in ("parameters", "optimizer_state", "inputs"):
        assert getattr(fake, part) == getattr(real, part), part
    if backbone == "tiny3d":  # the adapters' optimizer state, beside the head's alone on the frozen backbone
        frozen = project.config_training_estimate(
            quickstart(*changes[:1], *changes[2:], "model.freeze_backbone=true"), train.STEP, 16, 2
        )
        assert frozen.optimizer_state < fake.optimizer_state


@pytest.fixture(scope="module")
def backbone_weights(tmp_path_factory) -> str:
    """A tiny3d backbone's weights file, standing in for pretrained weights."""
    torch.manual_seed(7)
    path = str(tmp_path_factory.mktemp("weights") / "tiny3d.pth")
    torch.save(build_rgb_backbone("tiny3d", 8).state_dict(), path)
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_with_adapters_resumes_exactly_and_saves_them_without_the_frozen_weights(
    kind, backbone_weights, synthetic_root, tmp_path, caplog
):
    import train

    args = overrides(
        synthetic_root,
        tmp_path,
        f"model.adapter={kind}",
        f"model.pretrained={backbone_weights}",
        "train.max_epochs=1",
    )
    with caplog.at_level("INFO", logger="longvideo"):
        assert train.main(args + ["--set", "experiment=whole"]) == 0
    said = re.search(
        r"model.adapter: (\w+): ([\d,]+) parameters trained on the frozen backbone's ([\d,]+)", caplog.text
    )
    assert said and said[1] == kind and 0 < int(said[2].replace(",", "")) < int(said[3].replace(",", ""))
    assert train.main(args + ["--set", "experiment=parts", "--stop-after-steps", "2"]) == 0
    assert train.main(args + ["--set", "experiment=parts", "--resume", "auto"]) == 0
    whole, parts = (
        load_checkpoint(str(tmp_path / run / "latest" / "checkpoints" / "last.pt")) for run in ("whole", "parts")
    )
    assert parts.state.global_step == whole.state.global_step == 5
    assert whole.model.keys() == parts.model.keys()
    for key, value in whole.model.items():
        torch.testing.assert_close(parts.model[key], value, rtol=0, atol=0, msg=key)
    # the adapters and the classifier, not the backbone's own weights
    assert not any(k.startswith("rgb.") and ".lora_" not in k for k in whole.model)
    assert whole.frozen_weights["pretrained"] == backbone_weights and len(whole.frozen_weights["sha256"]) == 64
    best = str(tmp_path / "whole" / "latest" / "checkpoints" / "best.pt")
    done = run_in_process(["eval.py", "--checkpoint", best, "--split", "val"])
    assert done.returncode == 0, done.stderr[-2000:]
    long_video = os.path.join(synthetic_root, "long.jsonl")
    done = run_in_process(
        ["infer_chunked.py", "--checkpoint", best, "--input", long_video, "--features", str(tmp_path / "f")]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "f" / "long_00.npz").exists()


def test_adapters_on_other_weights_are_refused_and_whole_checkpoints_are_asked_for(
    backbone_weights, synthetic_root, tmp_path
):
    import shutil

    import train

    weights = str(tmp_path / "weights.pth")
    shutil.copy(backbone_weights, weights)
    args = overrides(synthetic_root, tmp_path, "model.adapter=block", f"model.pretrained={weights}")
    assert train.main(args + ["--stop-after-steps", "1"]) == 0
    last = str(tmp_path / "e2e" / "latest" / "checkpoints" / "last.pt")
    torch.manual_seed(8)
    torch.save(build_rgb_backbone("tiny3d", 8).state_dict(), weights)  # the weights file replaced since
    done = run_in_process(["eval.py", "--checkpoint", last, "--split", "val"])
    lines = error_lines(done.stderr)
    assert done.returncode != 0 and len(lines) == 1, done.stderr[-2000:]
    assert "trained on a frozen backbone of sha256" in lines[0] and "model.pretrained" in lines[0]
    with pytest.raises(Exception, match="trained on a frozen backbone of sha256"):
        train.main(args + ["--resume", last])


def test_a_hub_models_weights_saved_as_one_file_load_under_adapters(tmp_path):
    """docs/models.md's way to the preset's weights: a transformers model's state dict in one .safetensors file (here a
    tiny V-JEPA 2's, as the hub model's is written), loaded by model.pretrained into the frozen backbone."""
    import transformers

    if not hasattr(transformers, "VJEPA2Config"):
        pytest.skip(f"transformers {transformers.__version__} has no V-JEPA 2")
    from safetensors.torch import save_file

    tiny_video_transformer(tmp_path / "config", "vjepa2")
    torch.manual_seed(3)
    source = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "config"))
    save_file(source.state_dict(), str(tmp_path / "weights.safetensors"))
    cfg = quickstart(
        f"model.backbone=hf/{tmp_path / 'config'}", f"model.pretrained={tmp_path / 'weights.safetensors'}",
        "model.adapter=block",
    )  # fmt: skip
    model = build_model(cfg.model, 6)
    for name, value in source.state_dict().items():
        if not name.startswith("predictor."):  # dropped: the encoder's features are what the project uses
            torch.testing.assert_close(model.rgb.net.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_the_billion_parameter_preset_trains_its_adapters_alone():
    """configs/vit-g-adapters-24gb.yaml, built on the meta device (no memory, no weights): V-JEPA 2's ViT-g, about a
    billion parameters, with block adapters that train under 5% of them."""
    cfg = load_config(os.path.join(ROOT, "configs", "vit-g-adapters-24gb.yaml"))
    with torch.device("meta"):
        model = build_model(dataclasses.replace(cfg.model, pretrained=None), 10)
    backbone = sum(p.numel() for name, p in model.rgb.named_parameters())
    adapters = sum(p.numel() for p in model.adapters.parameters())
    assert model.rgb.feature_dim == 1408 and len(model.adapters.adapters) == 40 and 0.9e9 < backbone < 1.1e9
    assert all(not p.requires_grad for p in model.rgb.parameters()) and 0 < adapters < 0.05 * backbone


def test_batch_auto_takes_the_largest_batch_the_planner_fits_with_adapters():
    """batch auto searches over the same estimate for every kind (one kind here: the search is the same)."""
    from test_memory_estimate import fit  # the planner tests' budget arithmetic

    changes = ["model.adapter=lora", "model.temporal_head=transformer", "train.chunk_train_size=4"]
    peaks = {b: project.config_training_estimate(quickstart(*changes), train.STEP, 16, b).peak for b in (4, 5)}
    assert fit(quickstart("data.batch_size=auto", *changes), (peaks[4] + peaks[5]) // 2) == (4, 1)
