"""Chunk reconstruction (``model.chunk_reconstruction``): an auxiliary loss that keeps in each chunk's features what
tells that chunk apart from the others of its clip by colour, when the label alone does not ask for it.

A label that relates far events (was the second attempt like the first, does the end match the start) is the same
when the events' kinds are swapped, so at the start it pushes the backbone neither towards telling those kinds
apart nor away from it; what the backbone learns meanwhile from fitting the training clips can merge them, and the
head cannot find a relation in features that no longer hold it. A clip of one chunk has nothing to tell apart: its
target is zeros, and the decoder still trains (a parameter without a gradient would stall DDP).

The loss: a linear decoder from each chunk's features (the temporal head's input) predicts the chunk's thumbnail,
the mean colour in ``THUMBNAIL`` bins of time, height and width (48 values a chunk), as a difference from its clip's
mean chunk over the clip's root mean square difference (what the chunk does that its clip does not, one scale a
clip, as the head's contrast); its mean squared error, times the weight. Kinds of event that differ in colour or in
where they are stay apart; kinds that differ by motion, texture at one brightness or a rhythm do not.

The thumbnail is read from the uint8 frames the chunk is computed from, without a graph: a pooling, no second
backbone forward. The decoder trains with the backbone and is used nowhere else (evaluation and inference never
run it).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from models.temporal import clip_contrast

THUMBNAIL = (4, 2, 2)  # bins of time, height and width


def thumbnail_size(channels: int = 3) -> int:
    return channels * THUMBNAIL[0] * THUMBNAIL[1] * THUMBNAIL[2]


def chunk_thumbnail(video: torch.Tensor) -> torch.Tensor:
    """uint8 or float frames [B, C, T, H, W] (or [B, V, C, T, H, W]: views averaged) -> [B, thumbnail_size()]: the
    mean colour in ``THUMBNAIL`` bins, on the 0..1 scale for uint8. Fewer frames (or pixels) than bins are
    repeated into them."""
    with torch.no_grad():
        x = video.float() / 255 if video.dtype == torch.uint8 else video.float()
        if x.dim() == 6:
            x = x.mean(dim=1)
        return F.adaptive_avg_pool3d(x, THUMBNAIL).flatten(1)


class ChunkDecoder(nn.Module):
    """The linear decoder of the module docstring and its loss weight."""

    def __init__(self, feature_dim: int, weight: float, channels: int = 3):
        super().__init__()
        self.weight = weight
        self.decode = nn.Linear(feature_dim, thumbnail_size(channels))

    @staticmethod
    def thumbnail(video: torch.Tensor) -> torch.Tensor:
        return chunk_thumbnail(video)

    def forward(self, features: torch.Tensor, thumbnails: torch.Tensor) -> torch.Tensor:
        """The weighted loss of chunk features [B, n, D] against the chunks' thumbnails [B, n, P]."""
        predicted = self.decode(features.float())
        return self.weight * F.mse_loss(predicted, clip_contrast(thumbnails.to(features.device), None))
