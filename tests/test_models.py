import os

import pytest
import torch
from torchvision.models import video as tv_video

from config import load_config
from models import build_model, build_rgb_backbone, registered_names


def model_cfg(**changes):
    return load_config(
        None, [f"model.{k}={v}" for k, v in changes.items()] + ["model.width=4", "data.load_kpt=true"]
    ).model


@pytest.mark.parametrize("input_type", ["rgb", "kpt", "rgb_kpt"])
@pytest.mark.parametrize("view_fusion,views", [("none", 1), ("mean", 3), ("concat", 3), ("late", 2)])
def test_every_input_type_and_view_fusion_runs_forward_and_backward(input_type, view_fusion, views):
    model = build_model(model_cfg(input_type=input_type, view_fusion=view_fusion), 4, views, kpt_shape=(5, 3))
    video = torch.randn(2, 3, 8, 16, 16) if views == 1 else torch.randn(2, views, 3, 8, 16, 16)
    kpt = torch.rand(2, 8, 5, 3)
    kpt[0, 2, 1] = float("nan")  # a missing joint is masked, not propagated
    logits = model({"video": video, "kpt": kpt})
    assert logits.shape == (2, 4) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["tiny3d", "r3d_18"])
def test_gradient_checkpointing_gives_the_same_gradients(name):
    torch.manual_seed(0)
    model = build_model(model_cfg(backbone=name), 3)
    model.train()
    clip = {"video": torch.randn(2, 3, 4, 32, 32)}

    def grads(enabled):
        model.set_recompute_blocks(enabled)
        model.zero_grad()
        torch.manual_seed(1)
        model(clip).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for plain, checkpointed in zip(grads(False), grads(True)):
        torch.testing.assert_close(plain, checkpointed, rtol=1e-4, atol=1e-5)


def small_shape(backbone) -> tuple:
    """The smallest clip a backbone takes: its fixed shape (mvit_v2_s), else its minimum frames at 32x32."""
    return getattr(backbone, "shape", (max(1, backbone.min_frames), 32, 32))


@pytest.mark.parametrize("name", registered_names())
def test_every_registered_backbone_runs_forward_and_backward_at_its_smallest_clip(name):
    model = build_model(model_cfg(backbone=name, recompute_blocks="true"), 3)
    shape = small_shape(model.rgb)
    clips = 1 if hasattr(model.rgb, "shape") else 2  # one 224x224 clip of the fixed-shape transformer: its whole cost
    logits = model({"video": torch.randn(clips, 3, *shape)})
    assert logits.shape == (clips, 3)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["r3d_18", "mc3_18", "r2plus1d_18", "s3d", "swin3d_t", "mvit_v2_s"])
def test_a_torchvision_state_dict_loads_under_the_same_names(name, tmp_path):
    reference = getattr(tv_video, name)(weights=None)
    path = tmp_path / f"{name}.pth"
    torch.save(reference.state_dict(), path)  # a file as torchvision distributes them
    model = build_model(model_cfg(backbone=name, pretrained=str(path)), 5)
    own = model.rgb.net.state_dict()
    for key, value in reference.state_dict().items():
        if key in own:
            torch.testing.assert_close(own[key], value, msg=key)
    assert sum(k in own for k in reference.state_dict()) >= len(own) - 2


def test_pretrained_true_without_network_says_where_to_put_the_file(monkeypatch):
    from torchvision.models import get_model_weights

    def offline(self, *args, **kwargs):
        raise OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(type(get_model_weights("r3d_18").DEFAULT), "get_state_dict", offline)
    with pytest.raises(ValueError) as info:
        build_model(model_cfg(backbone="r3d_18", pretrained="true"), 5)
    message = str(info.value)
    assert message.startswith("model.pretrained: true: could not download torchvision's r3d_18 weights ([Errno -3]")
    cache = os.path.join(torch.hub.get_dir(), "checkpoints")
    assert message.endswith(f" on a machine with network and put it in {cache}/ here (read from there without network)")
    assert "https://download.pytorch.org/models/r3d_18-" in message and "\n" not in message


def test_pretrained_weights_of_another_model_are_refused(tmp_path):
    torch.save(tv_video.r3d_18(weights=None).state_dict(), tmp_path / "r3d.pth")
    with pytest.raises(ValueError, match=r"shapes differ from r2plus1d_18 .*are these weights of another model\?"):
        build_model(model_cfg(backbone="r2plus1d_18", pretrained=str(tmp_path / "r3d.pth")), 5)


def test_a_clip_of_the_wrong_shape_for_mvit_names_the_shape_it_needs():
    model = build_model(model_cfg(backbone="mvit_v2_s"), 3).eval()
    with pytest.raises(ValueError) as info, torch.no_grad():
        model({"video": torch.randn(1, 3, 8, 112, 112)})
    assert str(info.value) == (
        "mvit_v2_s needs clips of exactly 16 frames at 224x224, got 8x112x112; set "
        "data.num_frames: 16, data.img_size: [224, 224] and infer.chunk_size: 16"
    )


def test_unknown_model_lists_the_known_names():
    with pytest.raises(ValueError) as info:
        build_rgb_backbone("resnet9000")
    assert str(info.value) == f"unknown model 'resnet9000'; known: {', '.join(registered_names())}"
