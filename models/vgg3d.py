"""A small VGG-style 3D CNN: four stages of two 3x3x3 convolutions and a pooling, widths w, 2w, 4w, 8w."""

from torch import nn

from models.classifier import StagedBackbone, batch_norm
from models.registry import register_backbone


def vgg_stage(cin: int, cout: int, pool: tuple) -> nn.Sequential:
    layers = []
    for c in (cin, cout):
        layers += [nn.Conv3d(c, cout, 3, padding=1, bias=False), batch_norm(cout, dims=3), nn.ReLU(inplace=True)]
    # ceil_mode: a 1-frame (or 1-pixel) input still pools to 1
    return nn.Sequential(*layers, nn.MaxPool3d(pool, pool, ceil_mode=True))


@register_backbone("vgg3d")
class VGG3D(StagedBackbone):
    min_frames = 1

    def __init__(self, width: int = 32):
        super().__init__()
        self.stages = nn.ModuleList(
            [
                vgg_stage(3, width, (1, 2, 2)),
                vgg_stage(width, 2 * width, (2, 2, 2)),
                vgg_stage(2 * width, 4 * width, (2, 2, 2)),
                vgg_stage(4 * width, 8 * width, (2, 2, 2)),
            ]
        )
        self.feature_dim = 8 * width
