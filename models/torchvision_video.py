"""torchvision's video ResNets (r3d_18, mc3_18, r2plus1d_18) as staged backbones.

The torchvision module is kept whole as ``self.net`` (its fc replaced by identity), so a torchvision
state dict loads into it with the same key names.
"""
from torch import nn
from torchvision.models import video as tv_video

from models import register_backbone
from models.classifier import StagedBackbone


class TorchvisionVideoResNet(StagedBackbone):
    min_frames = 1  # temporal stride 2 with padding 1 in layers 2-4 keeps T >= 1

    def __init__(self, factory):
        super().__init__()
        self.net = factory(weights=None)
        self.feature_dim = self.net.fc.in_features
        self.net.fc = nn.Identity()

    @property
    def stages(self):
        # a property, not a ModuleList: the stages stay registered once, under torchvision's names
        return [self.net.stem, self.net.layer1, self.net.layer2, self.net.layer3, self.net.layer4]


def _torchvision_factory(name: str):
    def build(width=None, norm: str = "batch"):
        if norm != "batch":
            raise ValueError(f"model.norm: {norm} is not available for {name} (torchvision's BatchNorm layers); "
                             f"use norm: batch, or backbone tiny3d")
        return TorchvisionVideoResNet(getattr(tv_video, name))
    return build


for _name in ("r3d_18", "mc3_18", "r2plus1d_18"):
    register_backbone(_name)(_torchvision_factory(_name))
