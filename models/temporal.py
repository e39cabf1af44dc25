"""The temporal head: a model over a clip's chunk features, so a long window is more than a bag of short clips.

Chunk logits averaged (``model.temporal_head: none``) are blind to order: a label that depends on what happens
across chunks (this event before that one, how many times, what came last) cannot be learned. With a head, the
backbone gives one feature vector per chunk, and the head sees the whole sequence:

    features  [B, n, D]   each chunk's backbone features (views and keypoints fused per chunk)
    windows   [n, 2]      each chunk's [start, end) in video frames, counted from the clip's first frame
                          (or [B, n, 2]: one row of windows per clip)
    ->  clip logits [B, K]  and  chunk logits [B, n, K] (each token through the classifier: the timeline and
                                                         ``train.chunk_loss: dense``)

- ``attention``: each chunk's feature projected to ``WIDTH`` plus its position, pooled by attention with a learned
  query; chunk logits see their own chunk only. Its order comes from the positions alone.
- ``transformer``: the same, after ``LAYERS`` pre-norm encoder layers over the chunk tokens, so each chunk's logits
  (the timeline) see context from both sides. Its attention is directional: half the heads of each layer attend to
  the chunks up to their own, the other half to the chunks from their own on (the forward and backward masks of
  DiSAN, Shen et al., AAAI 2018), so order is in the tokens from the first step (a token averaging every chunk is
  the same whatever their order). Each token is made of three parts of its chunk:

  - its features through a LayerNorm: the backbone's pooled features shift and scale with the whole clip (its
    brightness, its contrast), which would move every token of the clip and drown the positions added to them;
  - its contrast (``clip_contrast``): the chunk's difference from the clip's mean chunk, over the clip's root mean
    square difference. In a long clip most chunks look alike (the scene, the background) and the few that differ
    carry the label; the contrast removes what all chunks share and keeps how much each differs (one scale a clip),
    so attention can pick the events out from the start;
  - the running sum of the contrast up to the chunk (``running_contrast``): how much of each kind of event has come
    so far, for labels that relate far events (does the end match the start, which half held more of one event).
- ``tcn``: a multi-stage temporal convolutional network as MS-TCN (Farha and Gall, CVPR 2019) defines it, the
  temporal action segmentation baseline: ``TCN_STAGES`` stages of ``TCN_LAYERS`` dilated residual layers (kernel 3,
  dilation 1, 2, 4, ...: a receptive field of 2^layers chunks), each later stage refining the softmax of the one
  before; linear in the number of chunks, so a whole video of thousands of chunks trains in one forward. Clip logits
  are its last stage's chunk logits averaged. Its per-stage logits (``HeadOutput.stages``) train with the paper's
  loss: cross-entropy on every stage plus 0.15 x the truncated MSE of neighbouring chunks' log-probabilities
  (engine.training.step).

``mask`` [B, n] (True for real chunks) lets clips of different lengths share a batch (features of whole videos,
padded): padded chunks change nothing in the real ones' outputs.

At inference the head sees at most as many chunks at once as it was trained on (``chunks_at_once``,
``infer.head_chunks``: auto; the chunks it trains on are counted in the ``trained_chunks`` buffer, saved with
its weights). A longer video runs in spans of that many chunks overlapping by half, each span's positions counted
from its first chunk as a training clip's are; each chunk keeps the outputs of the span it is most central in. The
clip logits come from one pass over every chunk: a label about the whole video needs all of it.

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

from models.chunk_attention import Encoder, EncoderLayer

WIDTH = 64  # the tokens of the attention and transformer heads, and MS-TCN's feature maps
ATTENTION_HEADS = 4
LAYERS = 2  # the transformer head's encoder layers
TCN_STAGES, TCN_LAYERS, TCN_DROPOUT = 4, 10, 0.5  # MS-TCN's


class HeadOutput(NamedTuple):
    """A clip's logits and its chunks': a temporal head's, and the training forward's (engine.inference.chunks) with or
    without a head."""

    clip: torch.Tensor | None  # [B, K]; None from a training forward without a head (the loss aggregates chunks)
    chunks: torch.Tensor  # [B, n, K]
    stages: list | None = None  # tcn: every stage's [B, n, K] (the last is ``chunks``), for the multi-stage loss
    auxiliary: torch.Tensor | None = None  # the training forward's weighted auxiliary loss (chunk reconstruction)


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
        self.layers = nn.ModuleList(DilatedResidual(width, 2**i, dropout) for i in range(layers))
        self.outward = nn.Conv1d(width, num_classes, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, C, n] -> [B, K, n] logits, zero at padded chunks."""
        out = self.inward(x) * mask
        for layer in self.layers:
            out = layer(out, mask)
        return self.outward(out) * mask


def real_chunks(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, n, 1] 1.0 at each clip's real chunks of ``mask`` [B, n] (None: all), on ``x``'s device."""
    return (torch.ones(x.shape[:2], device=x.device) if mask is None else mask.to(x.device).float()).unsqueeze(-1)


def clip_rms(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[B, 1, 1] the root mean square of ``x`` [B, n, D] over each clip's real chunks and features (``x`` is zero
    at the padded ones)."""
    values = real.sum(dim=1, keepdim=True).clamp_min(1) * x.shape[-1]
    # clamped: the square root's gradient at zero (a clip whose chunks are all alike) is infinite, and would make
    # every gradient of the step NaN
    return (x.pow(2).sum(dim=(1, 2), keepdim=True) / values).clamp_min(1e-12).sqrt()


def clip_contrast(features: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, n, D] chunk features -> each chunk's difference from its clip's mean chunk, divided by the clip's root
    mean square difference (one scale a clip, so a chunk that differs little stays small beside one that differs
    much). Over the real chunks of ``mask`` [B, n] (padded ones are zero); a clip whose chunks are all alike
    gives (nearly) zeros."""
    real = real_chunks(features, mask)
    x = features.float() * real
    centred = (x - x.sum(dim=1, keepdim=True) / real.sum(dim=1, keepdim=True).clamp_min(1)) * real
    # differences below a thousandth of the features' own size (rounding in a clip where nothing changes) are not
    # blown up to unit size
    scale = torch.maximum(clip_rms(centred, real), 1e-3 * clip_rms(x, real))
    return (centred / (scale + 1e-6)).to(features.dtype)


def running_contrast(contrast: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, n, D] the contrast of ``clip_contrast`` -> its running sum over the chunks up to each (in time order),
    divided by the clip's root mean square of it (one scale a clip). How much of each kind of event has come so
    far: which came first, how many of one before another. Padded chunks (zero contrast) add nothing and are
    zeroed."""
    real = real_chunks(contrast, mask)
    running = contrast.float().cumsum(dim=1) * real
    return (running / (clip_rms(running, real) + 1e-6)).to(contrast.dtype)


def span_starts(n: int, size: int) -> list[int]:
    """The first chunk of each span of ``size`` chunks over ``n`` (> size), overlapping by half, the last
    ending with the last chunk."""
    hop = max(size - size // 2, 1)
    starts = list(range(0, n - size, hop))
    return starts + [n - size]


def most_central(n: int, size: int, starts: list[int]) -> torch.Tensor:
    """[n] for each chunk the index of the span of ``size`` chunks (``starts``) where it is farthest from a span's
    edge."""
    index = torch.arange(n)
    begin = torch.tensor(starts)
    inside = (index[:, None] >= begin[None]) & (index[:, None] < begin[None] + size)  # [n, spans]
    margin = torch.minimum(index[:, None] - begin[None], begin[None] + size - 1 - index[:, None])
    return torch.where(inside, margin, -1).argmax(dim=1)


class TemporalHead(nn.Module):
    """What every kind of head shares: the count of the chunks it trained on, and inference in spans of that many
    (the module docstring). A kind defines ``_forward``: features [B, n, D] at windows -> HeadOutput."""

    kind = ""

    def __init__(self, chunks_at_once: int | str):
        super().__init__()
        self.chunks_at_once = chunks_at_once  # at inference: "auto" (trained_chunks), -1 (all), or a number
        # the most real chunks of a clip the head has trained on (0: not trained yet)
        self.register_buffer("trained_chunks", torch.zeros((), dtype=torch.long))

    def reach(self) -> int | None:
        """The most chunks one forward sees at inference; None: all of them."""
        if self.chunks_at_once == "auto":
            trained = int(self.trained_chunks)
            return trained if trained > 0 else None
        return None if int(self.chunks_at_once) < 0 else int(self.chunks_at_once)

    def forward(self, features: torch.Tensor, windows: torch.Tensor, mask: torch.Tensor | None = None) -> HeadOutput:
        """Clip logits [B, K] and chunk logits [B, n, K] of chunk features [B, n, D] at ``windows``; ``mask``
        [B, n] marks the real chunks of padded clips (None: all are). In training the clip lengths are counted
        (``trained_chunks``); at inference a clip longer than ``reach()`` runs in spans of that many chunks."""
        if self.training:
            with torch.no_grad():
                real = torch.tensor(features.shape[1]) if mask is None else mask.sum(dim=1).max()
                # on the buffer's device, without reading it back: no synchronization in the training step
                self.trained_chunks.copy_(torch.maximum(self.trained_chunks, real.to(self.trained_chunks.device)))
        else:
            reach = self.reach()
            if reach is not None and features.shape[1] > reach:
                return self._in_spans(features, windows, mask, reach)
        return self._forward(features, windows, mask)

    def _forward(self, features: torch.Tensor, windows: torch.Tensor, mask: torch.Tensor | None = None) -> HeadOutput:
        raise NotImplementedError

    def _in_spans(
        self, features: torch.Tensor, windows: torch.Tensor, mask: torch.Tensor | None, reach: int
    ) -> HeadOutput:
        """Each clip's real chunks in spans of ``reach`` chunks (module docstring), outputs back in place."""
        batch, n = features.shape[:2]
        windows = windows.expand(batch, *windows.shape[-2:]) if windows.dim() == 2 else windows
        clips, chunk_out, stage_out = [], None, None
        for b in range(batch):
            real = torch.arange(n, device=features.device) if mask is None else mask[b].nonzero()[:, 0]
            x, at = features[b, real][None], windows[b, real.to(windows.device)]
            if len(real) <= reach:
                out = self._forward(x, at)
                parts, clip = [out.chunks, *(out.stages or [])], out.clip
            else:
                parts, clip = self._stitched(x, at, reach)
            if chunk_out is None:
                shape = (batch, n, parts[0].shape[-1])
                chunk_out = parts[0].new_zeros(shape)
                stage_out = [parts[0].new_zeros(shape) for _ in parts[1:]]
            for target, part in zip([chunk_out, *stage_out], parts):
                target[b, real] = part[0]
            clips.append(clip[0])
        return HeadOutput(torch.stack(clips), chunk_out, stage_out or None)

    def _stitched(self, x: torch.Tensor, at: torch.Tensor, reach: int) -> tuple[list, torch.Tensor]:
        """One clip's chunk features [1, n, D] at ``at`` [n, 2]: its chunk outputs (the chunk logits, then each tcn
        stage's) through spans of ``reach`` chunks, each from the span the chunk is most central in; its clip
        logits from one pass over every chunk (a label about the whole video needs all of it)."""
        n = x.shape[1]
        starts = span_starts(n, reach)
        outs = [self._forward(x[:, s : s + reach], at[s : s + reach] - at[s, 0]) for s in starts]
        pick = most_central(n, reach, starts).to(x.device)
        offset = torch.arange(n, device=x.device) - torch.tensor(starts, device=x.device)[pick]
        per_span = [[o.chunks, *(o.stages or [])] for o in outs]  # each [1, reach, K]
        parts = [torch.cat([w[i] for w in per_span])[pick, offset][None] for i in range(len(per_span[0]))]
        return parts, self._forward(x, at).clip


class AttentionHead(TemporalHead):
    """``attention``: each chunk's features projected to ``WIDTH`` plus its position, pooled by attention with a
    learned query; chunk logits see their own chunk only."""

    kind = "attention"

    def __init__(self, feature_dim: int, num_classes: int, chunks_at_once: int | str):
        super().__init__(chunks_at_once)
        self.project = nn.Linear(feature_dim, WIDTH)
        self.encoder = None  # the transformer's
        self._add_pooling(num_classes)

    def _add_pooling(self, num_classes: int) -> None:
        self.query = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.02)
        self.pool = nn.MultiheadAttention(WIDTH, ATTENTION_HEADS, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        # a Sequential whose second entry is the linear layer: the checkpoints' key (classifier.1.*)
        self.classifier = nn.Sequential(nn.Identity(), nn.Linear(WIDTH, num_classes))

    @staticmethod
    def positions(windows: torch.Tensor) -> torch.Tensor:
        """[..., n, 2] chunk windows in video frames -> [..., n, WIDTH]: centre and length, half the width each."""
        windows = windows.float()
        centre, length = windows.mean(dim=-1), windows[..., 1] - windows[..., 0]
        return torch.cat([sinusoidal(centre, WIDTH // 2), sinusoidal(length, WIDTH - WIDTH // 2)], dim=-1)

    def _tokens(self, features: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return features

    def _forward(self, features: torch.Tensor, windows: torch.Tensor, mask: torch.Tensor | None = None) -> HeadOutput:
        features = self._tokens(features, mask)
        tokens = self.project(features) + self.positions(windows.to(features.device)).to(features.dtype)
        padding = None if mask is None else ~mask.to(features.device)
        if self.encoder is not None:
            tokens = self.encoder(tokens, None if mask is None else mask.to(features.device))
        query = self.query.expand(tokens.shape[0], -1, -1).to(tokens.dtype)
        pooled, _ = self.pool(query, tokens, tokens, key_padding_mask=padding, need_weights=False)
        return HeadOutput(self.classifier(self.norm(pooled[:, 0])), self.classifier(self.norm(tokens)))


class TransformerHead(AttentionHead):
    """``transformer``: the attention head after ``LAYERS`` pre-norm encoder layers with directional attention over
    the chunk tokens, each token made of its chunk's normalized features, its contrast and the contrast's running
    sum (the module docstring)."""

    kind = "transformer"

    def __init__(self, feature_dim: int, num_classes: int, chunks_at_once: int | str):
        # TemporalHead's, not AttentionHead's: the layers register in the order of the checkpoints (and of the
        # optimizer states) this head has always saved: input norm, projection, encoder, pooling
        TemporalHead.__init__(self, chunks_at_once)
        self.input_norm = nn.LayerNorm(feature_dim)
        self.project = nn.Linear(3 * feature_dim, WIDTH)  # features, contrast, running sum
        self.encoder = Encoder(EncoderLayer(WIDTH, ATTENTION_HEADS), LAYERS)
        self._add_pooling(num_classes)

    def _tokens(self, features: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        contrast = clip_contrast(features, mask)
        return torch.cat([self.input_norm(features), contrast, running_contrast(contrast, mask)], dim=-1)


class TCNHead(TemporalHead):
    """``tcn``: MS-TCN's stages (the module docstring). No projection, no positions (convolutions see relative
    time), no pooling: clip logits are the last stage's chunk logits averaged."""

    kind = "tcn"

    def __init__(self, feature_dim: int, num_classes: int, chunks_at_once: int | str):
        super().__init__(chunks_at_once)
        self.stages = nn.ModuleList(
            TCNStage(feature_dim if i == 0 else num_classes, WIDTH, num_classes, TCN_LAYERS, TCN_DROPOUT)
            for i in range(TCN_STAGES)
        )

    def _forward(self, features: torch.Tensor, windows: torch.Tensor, mask: torch.Tensor | None = None) -> HeadOutput:
        valid = (
            torch.ones(features.shape[:2], dtype=torch.bool, device=features.device)
            if mask is None
            else mask.to(features.device)
        )
        m = valid.unsqueeze(1).to(features.dtype)  # [B, 1, n]
        out = self.stages[0](features.transpose(1, 2), m)
        stages = [out]
        for stage in self.stages[1:]:
            out = stage(F.softmax(out, dim=1) * m, m)
            stages.append(out)
        chunks = [s.transpose(1, 2) for s in stages]  # [B, n, K] each
        clip = (chunks[-1] * m.transpose(1, 2)).sum(dim=1) / m.sum(dim=2).clamp_min(1)
        return HeadOutput(clip, chunks[-1], chunks)


KINDS = {"attention": AttentionHead, "transformer": TransformerHead, "tcn": TCNHead}


def temporal_head(
    feature_dim: int, num_classes: int, kind: str = "transformer", chunks_at_once: int | str = "auto"
) -> TemporalHead:
    """The head of ``kind`` (model.temporal_head); ``chunks_at_once``: infer.head_chunks."""
    if kind not in KINDS:
        raise ValueError(f"unknown temporal head '{kind}'; expected one of {', '.join(KINDS)}")
    return KINDS[kind](feature_dim, num_classes, chunks_at_once)


class FeatureHead(nn.Module):
    """The temporal head alone, over chunk features read from files (training on features, data.features_dir).
    Its state dict is the end-to-end classifier's ``temporal.*`` entries, so either loads into the other
    (eval.py and infer_chunked.py pair it with the backbone)."""

    def __init__(self, feature_dim: int, num_classes: int, kind: str, chunks_at_once: int | str = "auto"):
        super().__init__()
        self.feature_dim = feature_dim
        self.temporal = temporal_head(feature_dim, num_classes, kind, chunks_at_once)

    def forward(self, features: torch.Tensor, windows: torch.Tensor, mask: torch.Tensor | None = None) -> HeadOutput:
        return self.temporal(features, windows, mask)
