import pytest
import torch
from torchvision.models import video as tv_video

from config import load_config
from models import build_model, build_rgb_backbone, registered_names


def model_cfg(**changes):
    return load_config(None, [f"model.{k}={v}" for k, v in changes.items()] + ["model.width=4", "data.load_kpt=true"])["model"]


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
        model.set_grad_checkpointing(enabled)
        model.zero_grad()
        torch.manual_seed(1)
        model(clip).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for plain, checkpointed in zip(grads(False), grads(True)):
        torch.testing.assert_close(plain, checkpointed, rtol=1e-4, atol=1e-5)


def test_one_frame_clips_work_for_every_registered_backbone():
    for name in registered_names():
        backbone = build_rgb_backbone(name, width=4).eval()
        with torch.no_grad():
            assert backbone(torch.randn(1, 3, max(1, backbone.min_frames), 32, 32)).shape[1] == backbone.feature_dim


def test_a_torchvision_state_dict_loads_under_the_same_names():
    reference = tv_video.r3d_18(weights=None)
    backbone = build_rgb_backbone("r3d_18")
    state = {k: v for k, v in reference.state_dict().items() if not k.startswith("fc.")}
    missing, unexpected = backbone.net.load_state_dict(state, strict=False)
    assert missing == [] and unexpected == []
    torch.testing.assert_close(backbone.net.stem[0].weight, reference.stem[0].weight)


def test_unknown_model_lists_the_known_names():
    with pytest.raises(ValueError) as info:
        build_rgb_backbone("resnet9000")
    assert str(info.value) == f"unknown model 'resnet9000'; known: {', '.join(registered_names())}"
