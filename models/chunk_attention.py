"""Directional attention over a clip's chunks in memory linear in their number (an hour of video is 11,250 chunks: no
n x n tensor is built), and the encoder layers of the transformer head built on it."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F


def in_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[B, H, n, d] with each clip's positions taken in ``order`` [B, n]."""
    return x.gather(2, order[:, None, :, None].expand_as(x))


def causal_order(real: torch.Tensor, backward: bool) -> torch.Tensor:
    """[B, n] each clip's positions with its real chunks (``real`` [B, n]) first, in time order or (``backward``)
    reversed, then its padding: attention that is causal in this order sees, from each real chunk, the real
    chunks up to it (or from it on), never a padded one. A sort, not a branch on values: the planner's fake
    tensors run it too."""
    n = real.shape[1]
    position = torch.arange(n, device=real.device)
    key = (n - 1 - position if backward else position) + n * (~real).long()
    return key.argsort(dim=1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, H, n, d] scaled dot-product attention where each query sees the keys up to its own, in memory linear in
    n (F.scaled_dot_product_attention's fused kernels with ``is_causal``: no n x n mask is built)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def directional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """[B, H, n, d] attention where heads 0 .. ceil(H / 2) - 1 see the chunks up to their own and the rest the
    chunks from their own on, each direction causal: no n x n mask is built. The backward heads run causally over
    the chunks reversed. ``real`` [B, n]: each clip's real chunks (None: all); a real chunk never sees a padded
    one, in either direction."""
    forward = (q.shape[1] + 1) // 2
    halves = [(q[:, :forward], k[:, :forward], v[:, :forward], False)]
    if forward < q.shape[1]:
        halves.append((q[:, forward:], k[:, forward:], v[:, forward:], True))
    out = []
    for q_half, k_half, v_half, backward in halves:
        if real is None:
            flip = (lambda x: x.flip(2)) if backward else (lambda x: x)
            out.append(flip(causal_attention(flip(q_half), flip(k_half), flip(v_half))))
            continue
        order = causal_order(real, backward)
        ordered = causal_attention(*(in_order(t, order) for t in (q_half, k_half, v_half)))
        out.append(in_order(ordered, order.argsort(dim=1)))
    return torch.cat(out, dim=1)


class EncoderLayer(nn.Module):
    """The pre-norm encoder layer of ``nn.TransformerEncoderLayer(norm_first=True, batch_first=True)``, with its
    parameter names and its creation order (a seed initializes it as it did), its attention directional and in
    memory linear in the chunks (``directional_attention``: no n x n tensor)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.self_attn = nn.MultiheadAttention(width, heads, batch_first=True)  # in_proj_*, out_proj
        self.linear1 = nn.Linear(width, 2 * width)
        self.linear2 = nn.Linear(2 * width, width)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """``real`` [B, n]: each clip's real chunks (None: all)."""
        x = x + self._attend(self.norm1(x), real)
        return x + self.linear2(F.relu(self.linear1(self.norm2(x))))

    def _attend(self, x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        batch, n, width = x.shape
        attn = self.self_attn
        q, k, v = (
            F.linear(x, attn.in_proj_weight, attn.in_proj_bias)
            .view(batch, n, 3, self.heads, width // self.heads)
            .permute(2, 0, 3, 1, 4)
        )  # each [B, H, n, d]
        out = directional_attention(q, k, v, real)
        return attn.out_proj(out.transpose(1, 2).reshape(batch, n, width))


class Encoder(nn.Module):
    """``nn.TransformerEncoder``'s stack (its ``layers.N.*`` names; every layer starts as a copy of the first, as
    there) of EncoderLayer."""

    def __init__(self, layer: EncoderLayer, count: int):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(count))

    def forward(self, x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, real)
        return x
