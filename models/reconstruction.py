"""Chunk reconstruction (``model.chunk_reconstruction``): an auxiliary loss that keeps in each chunk's features what
tells that chunk apart from the others of its clip, when the label alone does not ask for it.

A label that relates far events (was the second attempt like the first, does the end match the start) is the same
when the events' kinds are swapped, so at the start it pushes the backbone neither towards telling those kinds
apart nor away from it; what the backbone learns meanwhile from fitting the training clips can merge them, and the
head cannot find a relation in features that no longer hold it (``bench.long_range --part separability`` measures
it: bench/RESULTS.md, "The chunk reconstruction"). A clip of one chunk has nothing to tell apart: its target is
zeros, and the decoder still trains (a parameter without a gradient would stall DDP).

The loss: a linear decoder from each chunk's features (the temporal head's input) predicts the chunk's thumbnail,
pooled in ``THUMBNAIL`` bins of time, height and width, each of its parts as a difference from its clip's mean chunk
over the clip's root mean square difference (what the chunk does that its clip does not, one scale a clip, as the
head's contrast); the sum over the parts of each one's mean squared error, times the weight.
``model.chunk_reconstruction_target`` says what the thumbnail holds:

- ``colour``: the mean colour of each bin (48 values a chunk). Kinds of event that differ in colour or in where
  they are stay apart; kinds that differ by motion, texture at one brightness or a rhythm do not.
- ``colour_edges_motion``: beside the colour, on the grey frames, the mean edge strength across and along the rows
  in the same bins (stripes one way or the other), the mean change from one frame to the next in 16 bins of time
  and 2 x 2 of space (which side lights up when: a direction of motion) and its mean size in 16 bins of time (how
  often the light changes: a rhythm): 160 values a chunk. The change is at the clip's frame rate: an event of two
  clip frames inside a chunk keeps its direction, which four bins of mean colour average away. Measured on the
  task families (bench/RESULTS.md, "A target beyond colour"), it helps where events differ by texture and costs
  the colour relations that ``colour`` learns: an option, not the default.

The thumbnail is read from the uint8 frames the chunk is computed from, without a graph: a pooling, no second
backbone forward. The decoder trains with the backbone and is used nowhere else (evaluation and inference never
run it).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from config.schema import RECONSTRUCTION_TARGETS
from models.temporal import clip_contrast

THUMBNAIL = (4, 2, 2)  # bins of time, height and width of the colour and the edges
CHANGE = (16, 2, 2)  # bins of the change from frame to frame: one a clip frame in a chunk of up to 17
RHYTHM = (16, 1, 1)  # bins of its size


def _bins(shape: tuple) -> int:
    return shape[0] * shape[1] * shape[2]


def thumbnail_parts(target: str = "colour", channels: int = 3) -> list[int]:
    """The sizes of a ``target`` thumbnail's parts, each relative to its clip on its own scale."""
    colour = [channels * _bins(THUMBNAIL)]
    return colour if target == "colour" else colour + [2 * _bins(THUMBNAIL), _bins(CHANGE), _bins(RHYTHM)]


def thumbnail_size(target: str = "colour", channels: int = 3) -> int:
    return sum(thumbnail_parts(target, channels))


def _difference(grey: torch.Tensor, dim: int) -> torch.Tensor:
    """Grey frames [B, 1, T, H, W] differenced along ``dim``; zeros where ``dim`` has one element."""
    return grey.diff(dim=dim) if grey.shape[dim] > 1 else torch.zeros_like(grey)


def _pooled(x: torch.Tensor, bins: tuple) -> torch.Tensor:
    return F.adaptive_avg_pool3d(x, bins).flatten(1)


def chunk_thumbnail(video: torch.Tensor, target: str = "colour") -> torch.Tensor:
    """uint8 or float frames [B, C, T, H, W] (or [B, V, C, T, H, W]: views averaged) -> [B, thumbnail_size(target)]:
    the mean colour in ``THUMBNAIL`` bins, on the 0..1 scale for uint8; for ``colour_edges_motion`` then, on the grey
    frames, the mean size of the differences along a row and along a column (edges across and along the rows) in
    the same bins, the mean change from one frame to the next in ``CHANGE`` bins (which side lights up when: a
    direction of motion) and its mean size in ``RHYTHM`` bins (how often the light changes). Fewer frames (or
    pixels) than bins are repeated into them; a chunk of one frame has no change (zeros)."""
    with torch.no_grad():
        x = video.float() / 255 if video.dtype == torch.uint8 else video.float()
        if x.dim() == 6:
            x = x.mean(dim=1)
        parts = [_pooled(x, THUMBNAIL)]
        if target == "colour_edges_motion":
            grey = x.mean(dim=1, keepdim=True)
            change = _difference(grey, 2)  # from frame to frame, once for both of its parts
            parts += [
                _pooled(_difference(grey, 4).abs(), THUMBNAIL),  # along a row: edges across it
                _pooled(_difference(grey, 3).abs(), THUMBNAIL),  # along a column: edges along the rows
                _pooled(change, CHANGE),
                _pooled(change.abs(), RHYTHM),
            ]
        return torch.cat(parts, dim=1)


class ChunkDecoder(nn.Module):
    """The linear decoder of the module docstring, its target and its loss weight."""

    def __init__(self, feature_dim: int, weight: float, target: str, channels: int = 3):
        super().__init__()
        if target not in RECONSTRUCTION_TARGETS:
            known = ", ".join(RECONSTRUCTION_TARGETS)
            raise ValueError(f"unknown chunk reconstruction target {target!r}; expected one of {known}")
        self.weight, self.target, self.parts = weight, target, thumbnail_parts(target, channels)
        self.decode = nn.Linear(feature_dim, sum(self.parts))

    def thumbnail(self, video: torch.Tensor) -> torch.Tensor:
        return chunk_thumbnail(video, self.target)

    def forward(self, features: torch.Tensor, thumbnails: torch.Tensor) -> torch.Tensor:
        """The weighted loss of chunk features [B, n, D] against the chunks' thumbnails [B, n, P]."""
        predicted = self.decode(features.float()).split(self.parts, dim=-1)
        targets = thumbnails.to(features.device).split(self.parts, dim=-1)
        # each part relative to the clip on its own scale, and weighed as one: a part added leaves the others' weight
        return self.weight * sum(F.mse_loss(p, clip_contrast(t, None)) for p, t in zip(predicted, targets))
