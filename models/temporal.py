"""The temporal head: a model over a clip's chunk features, so a long window is more than a bag of short clips.

Chunk logits averaged (``model.temporal_head: none``) are blind to order: a label that depends on what happens
across chunks (this event before that one, how many times, what came last) cannot be learned. With a head, the
backbone gives one feature vector per chunk, and the head sees the whole sequence:

    features  [B, n, D]   each chunk's backbone features (views and keypoints fused per chunk)
    windows   [n, 2]      each chunk's [start, end) in video frames, counted from the clip's first frame
                          (or [B, n, 2]: one row of windows per clip)
    ->  clip logits [B, K]  and  chunk logits [B, n, K] (each token through the classifier: the timeline and
                                                         ``train.chunk_loss: dense``)

- ``attention``: each chunk's feature projected to ``temporal_width`` plus its position, pooled by attention with
  a learned query; chunk logits see their own chunk only.
- ``transformer``: the same, after ``temporal_layers`` pre-norm encoder layers over the chunk tokens, so each
  chunk's logits (the timeline) see context from both sides.

Positions are sinusoidal encodings of each chunk's centre and length in video frames (the clip's frame stride is
in them): defined for any number of chunks and any length, so a 100,000-frame video at inference neither fails nor
is truncated. Every operation is per clip (LayerNorm, no BatchNorm): a clip's output does not depend on the other
clips of its micro-batch.
"""
from __future__ import annotations

import math

import torch
from torch import nn

HEADS = ("none", "attention", "transformer")


def sinusoidal(values: torch.Tensor, dim: int) -> torch.Tensor:
    """[...] positions (any real values) -> [..., dim] sin/cos features at periods from 2 pi to 2 pi * 10,000."""
    half = dim // 2
    frequencies = torch.exp(-math.log(10_000.0) * torch.arange(half, device=values.device) / max(half, 1))
    angles = values.float().unsqueeze(-1) * frequencies
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TemporalHead(nn.Module):
    def __init__(self, kind: str, feature_dim: int, num_classes: int, width: int = 64, layers: int = 2,
                 heads: int = 4, dropout: float = 0.1):
        super().__init__()
        if kind not in HEADS[1:]:
            raise ValueError(f"unknown temporal head '{kind}'; expected one of {', '.join(HEADS[1:])}")
        self.kind, self.width = kind, width
        self.project = nn.Linear(feature_dim, width)
        self.encoder = None
        if kind == "transformer":
            layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=dropout,
                                               batch_first=True, norm_first=True)
            # enable_nested_tensor off: the nested fast path would make a clip's output depend on its batch
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.query = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.pool = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(width, num_classes))

    def positions(self, windows: torch.Tensor) -> torch.Tensor:
        """[..., n, 2] chunk windows in video frames -> [..., n, width]: centre and length, half the width each."""
        windows = windows.float()
        centre, length = windows.mean(dim=-1), windows[..., 1] - windows[..., 0]
        return torch.cat([sinusoidal(centre, self.width // 2), sinusoidal(length, self.width - self.width // 2)],
                         dim=-1)

    def forward(self, features: torch.Tensor, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(clip logits [B, K], chunk logits [B, n, K]) of chunk features [B, n, D] at ``windows``."""
        tokens = self.project(features) + self.positions(windows.to(features.device)).to(features.dtype)
        if self.encoder is not None:
            tokens = self.encoder(tokens)
        query = self.query.expand(tokens.shape[0], -1, -1).to(tokens.dtype)
        pooled, _ = self.pool(query, tokens, tokens, need_weights=False)
        return self.classifier(self.norm(pooled[:, 0])), self.classifier(self.norm(tokens))
