"""A tiny 3D CNN: fast enough to train on a 2-core CPU (the demo and the tests)."""

from torch import nn

from models.classifier import StagedBackbone, batch_norm
from models.registry import register_backbone


def conv_norm_relu(cin: int, cout: int, stride: tuple) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv3d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False),
        batch_norm(cout, dims=3),
        nn.ReLU(inplace=True),
    )


@register_backbone("tiny3d")
class Tiny3D(StagedBackbone):
    min_frames = 1  # padding 1 on every temporal axis: any clip length works

    def __init__(self, width: int = 32):
        super().__init__()
        self.stages = nn.ModuleList(
            [
                conv_norm_relu(3, width, (1, 2, 2)),
                conv_norm_relu(width, 2 * width, (2, 2, 2)),
                conv_norm_relu(2 * width, 4 * width, (2, 2, 2)),
            ]
        )
        self.feature_dim = 4 * width
