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
  chunk's logits (the timeline) see context from both sides. Its attention is ``directional`` by default: half
  the heads of each layer attend to the chunks up to their own, the other half to the chunks from their own on
  (the forward and backward masks of DiSAN, Shen et al., AAAI 2018); ``bidirectional``: every head attends to
  every chunk (the head before ``model.temporal_attention``; older checkpoints load as that). Why, as we read
  the measurements: at initialization attention is nearly uniform, and a token that averages every chunk is the
  same whatever their order, so a bidirectional encoder starts nearly blind to order (only the per-token mixing
  of content and position, random at first, tells positions apart), and an order-defined label gives the
  backbone little gradient until the attention has learnt positions. A token that averages the chunks up to its
  own is not blind: pooled over the tokens, an early chunk weighs more in the forward half and a late one in the
  backward half, so which event came first is in the features from the first step. Measured: 64 chunks of 4
  clip frames, where bidirectional attention fitted the training clips at chance for 20 epochs, learnt to 1.000
  at seed 0 (0.833-1.000 over three seeds with the input norm; bench/RESULTS.md, "Long-range tasks").
- ``transformer`` puts each chunk's features through a LayerNorm before the projection (``input_norm``,
  ``model.temporal_input_norm``): the backbone's pooled features shift and scale with the whole clip (its
  brightness, its contrast), which would move every token of the clip and drown the positions added to them.
  Measured: the distractors family from the quickstart preset, whose colour jitter scales each clip's brightness,
  contrast and saturation, 0.812 best without it and 1.000 with it (seed 0; 0.833 and 0.562 at seeds 1 and 2;
  bench/RESULTS.md). Not the
  ``attention`` head's: with no encoder, its order comes from positions alone, and normalized features drowned
  them (the order task, seed 0: 0.521 with it, 0.812 without).
- ``transformer`` also gives each token its chunk's contrast (``contrast``, ``model.temporal_contrast``): the
  chunk's difference from the clip's mean chunk, over the clip's root mean square difference, beside its own
  normalized features. In a long clip most chunks look alike (the scene, the background) and the few that differ
  carry the label; each chunk's own features are mostly what every chunk shares, so at the start the tokens differ
  little and attention cannot pick the events out. The contrast removes what all chunks share and keeps how much
  each differs (one scale a clip: a chunk that differs little stays small). Its own features stay beside it, so a
  clip whose chunks all show the same action keeps its content. Measured: the head alone on features built like
  the distractors family (64 chunks that share one feature vector, the events added to a few; 96 training clips,
  144 steps; tests/test_head_learning.py) 0.560 without it, not fitting its training clips, and 0.995 with it; end
  to end, the distractors family from the quickstart preset went from 0.833 and 0.562 (seeds 1, 2) to 1.000 with
  it and the warm-up (bench/RESULTS.md, "Long-range tasks").
- ``tcn``: a multi-stage temporal convolutional network as MS-TCN (Farha and Gall, CVPR 2019) defines it, the
  temporal action segmentation baseline: ``temporal_stages`` stages of ``temporal_tcn_layers`` dilated residual
  layers (kernel 3, dilation 1, 2, 4, ...: a receptive field of 2^layers chunks), each later stage refining the
  softmax of the one before; linear in the number of chunks, so a whole video of thousands of chunks trains in
  one forward. Clip logits are its last stage's chunk logits averaged. Its per-stage logits (``HeadOutput.stages``)
  train with the paper's loss: cross-entropy on every stage plus 0.15 x the truncated MSE of neighbouring chunks'
  log-probabilities (engine.step).

``mask`` [B, n] (True for real chunks) lets clips of different lengths share a batch (features of whole videos,
padded): padded chunks change nothing in the real ones' outputs.

Positions are sinusoidal encodings of each chunk's centre and length in video frames (the clip's frame stride is
in them): defined for any number of chunks and any length, so a 100,000-frame video at inference neither fails nor
is truncated. Every operation is per clip (LayerNorm, no BatchNorm): a clip's output does not depend on the other
clips of its micro-batch.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

HEADS = ("none", "attention", "transformer", "tcn")


class HeadOutput(NamedTuple):
    clip: torch.Tensor  # [B, K]
    chunks: torch.Tensor  # [B, n, K]
    stages: list | None = None  # tcn: every stage's [B, n, K] (the last is ``chunks``), for the multi-stage loss


def sinusoidal(values: torch.Tensor, dim: int) -> torch.Tensor:
    """[...] positions (any real values) -> [..., dim] sin/cos features at periods from 2 pi to 2 pi * 10,000."""
    half = dim // 2
    frequencies = torch.exp(-math.log(10_000.0) * torch.arange(half, device=values.device) / max(half, 1))
    angles = values.float().unsqueeze(-1) * frequencies
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class DilatedResidual(nn.Module):
    """MS-TCN's layer: a dilated convolution (kernel 3), ReLU, a 1x1 convolution, dropout, the residual."""

    def __init__(self, width: int, dilation: int, dropout: float):
        super().__init__()
        self.dilated = nn.Conv1d(width, width, 3, padding=dilation, dilation=dilation)
        self.pointwise = nn.Conv1d(width, width, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (x + self.dropout(self.pointwise(F.relu(self.dilated(x))))) * mask


class TCNStage(nn.Module):
    def __init__(self, in_dim: int, width: int, num_classes: int, layers: int, dropout: float):
        super().__init__()
        self.inward = nn.Conv1d(in_dim, width, 1)
        self.layers = nn.ModuleList(DilatedResidual(width, 2 ** i, dropout) for i in range(layers))
        self.outward = nn.Conv1d(width, num_classes, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, C, n] -> [B, K, n] logits, zero at padded chunks."""
        out = self.inward(x) * mask
        for layer in self.layers:
            out = layer(out, mask)
        return self.outward(out) * mask


def directional_mask(padding: torch.Tensor | None, batch: int, n: int, heads: int,
                     device: torch.device) -> torch.Tensor:
    """The encoder's attention mask [batch * heads, n, n], True where a query chunk may not attend to a key chunk:
    heads 0 .. ceil(heads / 2) - 1 see the chunks up to their own, the rest the chunks from their own on.
    ``padding`` [batch, n] (True for padded chunks) hides padded keys; every chunk still sees itself, so a padded
    chunk's row is never all hidden (a NaN that the pooling would multiply by zero and keep)."""
    index = torch.arange(n, device=device)
    earlier = index[None, :] <= index[:, None]  # [query, key]: the key is not after the query
    later = index[None, :] >= index[:, None]
    allowed = torch.stack([earlier if h < (heads + 1) // 2 else later for h in range(heads)]).unsqueeze(0)
    if padding is not None:
        allowed = (allowed & ~padding[:, None, None, :]) | torch.eye(n, dtype=torch.bool, device=device)
    return ~allowed.expand(batch, heads, n, n).reshape(batch * heads, n, n)


def clip_contrast(features: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, n, D] chunk features -> each chunk's difference from its clip's mean chunk, divided by the clip's root
    mean square difference (one scale a clip, so a chunk that differs little stays small beside one that differs
    much). Over the real chunks of ``mask`` [B, n] (padded ones are zero); a clip whose chunks are all alike
    gives (nearly) zeros."""
    x = features.float()
    real = (torch.ones(x.shape[:2], device=x.device) if mask is None else mask.to(x.device).float()).unsqueeze(-1)
    x = x * real
    count = real.sum(dim=1, keepdim=True).clamp_min(1)
    centred = (x - x.sum(dim=1, keepdim=True) / count) * real
    values = count * x.shape[-1]
    scale = (centred.pow(2).sum(dim=(1, 2), keepdim=True) / values).sqrt()
    # differences below a thousandth of the features' own size (rounding in a clip where nothing changes) are not
    # blown up to unit size
    size = (x.pow(2).sum(dim=(1, 2), keepdim=True) / values).sqrt()
    return (centred / (torch.maximum(scale, 1e-3 * size) + 1e-6)).to(features.dtype)


class TemporalHead(nn.Module):
    def __init__(self, feature_dim: int, num_classes: int, kind: str = "transformer", width: int = 64, layers: int = 2,
                 heads: int = 4, dropout: float = 0.1, stages: int = 4, tcn_layers: int = 10,
                 attention: str = "directional", input_norm: bool = True, contrast: bool = True):
        super().__init__()
        if kind not in HEADS[1:]:
            raise ValueError(f"unknown temporal head '{kind}'; expected one of {', '.join(HEADS[1:])}")
        if attention not in ("directional", "bidirectional"):
            raise ValueError(f"unknown temporal attention '{attention}'; expected directional or bidirectional")
        self.kind, self.width, self.heads = kind, width, heads
        self.directional = kind == "transformer" and attention == "directional"
        self.contrast = kind == "transformer" and contrast
        if kind == "tcn":  # MS-TCN: no projection, no positions (convolutions see relative time), no pooling
            self.stages = nn.ModuleList(
                TCNStage(feature_dim if i == 0 else num_classes, width, num_classes, tcn_layers,
                         0.5 if dropout == 0.1 else dropout)  # the paper's dropout unless one is set
                for i in range(stages))
            return
        # the transformer's only: on the order task it took the attention head from 0.812 to 0.521 (seed 0)
        self.input_norm = nn.LayerNorm(feature_dim) if input_norm and kind == "transformer" else None
        self.project = nn.Linear(feature_dim * (2 if self.contrast else 1), width)
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

    def forward(self, features: torch.Tensor, windows: torch.Tensor,
                mask: torch.Tensor | None = None) -> HeadOutput:
        """Clip logits [B, K] and chunk logits [B, n, K] of chunk features [B, n, D] at ``windows``; ``mask``
        [B, n] marks the real chunks of padded clips (None: all are)."""
        if self.kind == "tcn":
            return self._tcn(features, mask)
        raw = features
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.contrast:
            features = torch.cat([features, clip_contrast(raw, mask)], dim=-1)
        tokens = self.project(features) + self.positions(windows.to(features.device)).to(features.dtype)
        padding = None if mask is None else ~mask.to(features.device)
        if self.directional:
            tokens = self.encoder(tokens, mask=directional_mask(padding, tokens.shape[0], tokens.shape[1], self.heads,
                                                                tokens.device))
        elif self.encoder is not None:
            tokens = self.encoder(tokens, src_key_padding_mask=padding)
        query = self.query.expand(tokens.shape[0], -1, -1).to(tokens.dtype)
        pooled, _ = self.pool(query, tokens, tokens, key_padding_mask=padding, need_weights=False)
        return HeadOutput(self.classifier(self.norm(pooled[:, 0])), self.classifier(self.norm(tokens)))

    def _tcn(self, features: torch.Tensor, mask: torch.Tensor | None) -> HeadOutput:
        valid = (torch.ones(features.shape[:2], dtype=torch.bool, device=features.device) if mask is None
                 else mask.to(features.device))
        m = valid.unsqueeze(1).to(features.dtype)  # [B, 1, n]
        out = self.stages[0](features.transpose(1, 2), m)
        stages = [out]
        for stage in self.stages[1:]:
            out = stage(F.softmax(out, dim=1) * m, m)
            stages.append(out)
        chunks = [s.transpose(1, 2) for s in stages]  # [B, n, K] each
        clip = (chunks[-1] * m.transpose(1, 2)).sum(dim=1) / m.sum(dim=2).clamp_min(1)
        return HeadOutput(clip, chunks[-1], chunks)


class FeatureHead(nn.Module):
    """The temporal head alone, over chunk features read from files (training on features, data.features_dir).
    Its state dict is the end-to-end classifier's ``temporal.*`` entries, so either loads into the other
    (eval.py and infer_chunked.py pair it with the backbone; model.temporal_head_init starts end-to-end training
    from it)."""

    def __init__(self, feature_dim: int, num_classes: int, **temporal):
        super().__init__()
        self.feature_dim = feature_dim
        self.temporal = TemporalHead(feature_dim, num_classes, **temporal)

    def forward(self, features: torch.Tensor, windows: torch.Tensor, mask: torch.Tensor | None = None) -> HeadOutput:
        return self.temporal(features, windows, mask)
