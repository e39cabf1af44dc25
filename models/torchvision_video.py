"""torchvision's video models as staged backbones: r3d_18, mc3_18, r2plus1d_18, s3d, swin3d_t, mvit_v2_s.

Each keeps the torchvision module whole as ``self.net`` (its classifier removed), so a torchvision state dict
loads into it under the same key names (``load_torchvision_weights``). Gradient checkpointing recomputes one
block at a time (ResNet residual blocks, S3D blocks, Swin blocks, MViT blocks).
"""

from __future__ import annotations

import torch
from torch import nn

from models.adapters import AdapterPoints
from models.classifier import StagedBackbone, recompute_in_backward
from models.registry import register_backbone


class TorchvisionVideoResNet(StagedBackbone):
    min_frames = 1  # temporal stride 2 with padding 1 in layers 2-4 keeps T >= 1

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.feature_dim = self.net.fc.in_features
        self.net.fc = nn.Identity()

    @property
    def stages(self):
        # a property, not a ModuleList: the stages stay registered once, under torchvision's names. One unit per
        # residual block, not per layer: the stem and layer1 hold most activations at full resolution, so
        # checkpointing whole layers kept most of them (r3d_18 at the rtx5080 clip, fp16, batch 12: estimated
        # 7.0 GiB without checkpointing, 6.0 GiB per layer, 4.6 GiB per block)
        net = self.net
        return [net.stem, *net.layer1, *net.layer2, *net.layer3, *net.layer4]


class TorchvisionS3D(StagedBackbone):
    # features[13] is a 2x2x2 max-pool after a 4x temporal reduction: 8 frames is the shortest clip it takes
    min_frames = 8
    min_size = 32  # four spatial halvings before that pool

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.feature_dim = 1024
        self.net.avgpool, self.net.classifier = nn.Identity(), nn.Identity()  # we pool by mean over T, H, W

    @property
    def stages(self):
        return list(self.net.features)  # one unit per block (see TorchvisionVideoResNet.stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] < self.min_size or x.shape[-1] < self.min_size:
            raise ValueError(
                f"s3d needs frames of at least {self.min_size}x{self.min_size}, got "
                f"{x.shape[-2]}x{x.shape[-1]}; raise data.img_size"
            )
        return super().forward(x)


class TorchvisionSwin3D(StagedBackbone):
    min_frames = 1  # the patch embedding pads T to its patch size

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.feature_dim = self.net.head.in_features
        self.net.head = nn.Identity()

    @property
    def stages(self):
        # one unit per transformer block and per patch merging (see TorchvisionVideoResNet.stages)
        units = [nn.Sequential(self.net.patch_embed, self.net.pos_drop)]
        for part in self.net.features:
            units.extend(part if isinstance(part, nn.Sequential) else [part])
        return units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.net.norm(self.run_stages(x))  # [B, T, H, W, C]
        return x.mean(dim=(1, 2, 3))

    def adapter_points(self) -> AdapterPoints:
        # after the patch embedding, which ``stages`` wraps anew on each call (a hook on it would never run)
        return AdapterPoints(self.stages[1:], "channels_last", (1, 3, 8, 224, 224))


class TorchvisionMViT(StagedBackbone):
    """MViT v2: its positional embedding fixes the clip shape (16 frames at 224x224 for mvit_v2_s)."""

    def __init__(self, net: nn.Module, name: str):
        super().__init__()
        self.net, self.name = net, name
        encoding = self.net.pos_encoding
        patch = self.net.conv_proj
        self.shape = (
            encoding.temporal_size * patch.stride[0],
            encoding.spatial_size[0] * patch.stride[1],
            encoding.spatial_size[1] * patch.stride[2],
        )
        self.min_frames = self.shape[0]  # the chunked forward pads shorter chunks to this
        self.feature_dim = self.net.head[-1].in_features
        self.net.head = nn.Identity()

    def adapter_points(self) -> None:
        return None  # a class token among its tokens, and pooling blocks that change their grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-3:]) != self.shape:
            t, h, w = self.shape
            raise ValueError(
                f"{self.name} needs clips of exactly {t} frames at {h}x{w}, got "
                f"{x.shape[-3]}x{x.shape[-2]}x{x.shape[-1]}; set data.num_frames: {t}, "
                f"data.img_size: [{h}, {w}] and infer.chunk_size: {t}"
            )
        net = self.net
        x = net.pos_encoding(net.conv_proj(x).flatten(2).transpose(1, 2))
        thw = (net.pos_encoding.temporal_size,) + tuple(net.pos_encoding.spatial_size)
        for block in net.blocks:
            if self.recompute_blocks and self.training and torch.is_grad_enabled():
                x, thw = recompute_in_backward(block, block, x, thw)
            else:
                x, thw = block(x, thw)
        return net.norm(x)[:, 0]  # the class token


def _video_models():
    from torchvision.models import video  # when one is built: torchvision's import loads torch's compiler

    return video


def _register(name: str, wrap):
    def build(width=None):
        return wrap(getattr(_video_models(), name)(weights=None))

    register_backbone(name)(build)


for _name in ("r3d_18", "mc3_18", "r2plus1d_18"):
    _register(_name, TorchvisionVideoResNet)
_register("s3d", TorchvisionS3D)
_register("swin3d_t", TorchvisionSwin3D)
_register("mvit_v2_s", lambda net: TorchvisionMViT(net, "mvit_v2_s"))


def _resnet3d(depth: int):
    """3D ResNets of the depths long-video guides name (resnet18/34/50): torchvision's VideoResNet built with
    full 3x3x3 convolutions (r3d) and the BasicBlock or Bottleneck of that depth."""
    layers = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3]}[depth]

    def build(width=None):
        resnet = _video_models().resnet
        block = resnet.BasicBlock if depth < 50 else resnet.Bottleneck
        net = resnet.VideoResNet(block, [resnet.Conv3DSimple] * 4, layers, resnet.BasicStem)
        return TorchvisionVideoResNet(net)

    return build


for _depth in (18, 34, 50):
    register_backbone(f"resnet{_depth}")(_resnet3d(_depth))
