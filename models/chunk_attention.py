"""Attention over a clip's chunks in memory linear in their number (an hour of video is 11,250 chunks: no n x n
tensor is built), directional or not, and the encoder layers of the transformer head built on it."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# the scores of one block of attention_with_dropout: a constant, whatever the number of chunks; above glibc's largest
# mmap threshold (32 MiB), so each block's memory goes back to the system when it is freed (smaller blocks stayed
# resident on the heap: 1.4 GB of RSS over 11,250 chunks)
BLOCK_BYTES = 64 * 2**20


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


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, keys: torch.Tensor | None, dropout: float
) -> torch.Tensor:
    """[B, H, n, d] scaled dot-product attention in memory linear in n: each query sees the keys up to its own
    (``causal``), or the keys ``keys`` [B, n] marks (None: all). F.scaled_dot_product_attention's fused kernels
    where they can run; with ``dropout`` on the CPU, where no fused kernel drops attention probabilities (torch
    would fall back to an n x n matrix), ``attention_with_dropout``."""
    if dropout > 0 and q.device.type == "cpu":
        return attention_with_dropout(q, k, v, causal, keys, dropout)
    mask = None if keys is None else keys[:, None, None, :]  # [B, 1, 1, n]: broadcast, never n x n
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)


def attention_with_dropout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, keys: torch.Tensor | None, dropout: float
) -> torch.Tensor:
    """The attention of ``attention``, its probabilities dropped, in blocks of queries whose scores take BLOCK_BYTES,
    each recomputed in backward (its dropout mask drawn again from the RNG state it had): one block's scores alive
    at a time, not n x n."""
    batch, heads, n, _ = q.shape
    block = max(1, BLOCK_BYTES // (batch * heads * k.shape[2] * 4))
    blocks = [
        checkpoint(
            attention_block, q[:, :, start : start + block], k, v, start, causal, keys, dropout, use_reentrant=False
        )
        for start in range(0, n, block)
    ]
    return torch.cat(blocks, dim=2)


def attention_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    causal: bool,
    keys: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # [B, H, block, n]
    if causal:
        queries = torch.arange(start, start + q.shape[2], device=q.device)
        scores = scores.masked_fill(torch.arange(k.shape[2], device=q.device) > queries[:, None], float("-inf"))
    if keys is not None:
        scores = scores.masked_fill(~keys[:, None, None, :], float("-inf"))
    return F.dropout(scores.softmax(dim=-1), dropout) @ v


def directional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None, dropout: float = 0.0
) -> torch.Tensor:
    """[B, H, n, d] attention where heads 0 .. ceil(H / 2) - 1 see the chunks up to their own and the rest the
    chunks from their own on, each direction causal (``attention``): no n x n mask is built. The backward heads
    run causally over the chunks reversed. ``real`` [B, n]: each clip's real chunks (None: all); a real chunk
    never sees a padded one, in either direction."""
    forward = (q.shape[1] + 1) // 2
    halves = [(q[:, :forward], k[:, :forward], v[:, :forward], False)]
    if forward < q.shape[1]:
        halves.append((q[:, forward:], k[:, forward:], v[:, forward:], True))
    out = []
    for q_half, k_half, v_half, backward in halves:
        if real is None:
            flip = (lambda x: x.flip(2)) if backward else (lambda x: x)
            out.append(flip(attention(flip(q_half), flip(k_half), flip(v_half), True, None, dropout)))
            continue
        order = causal_order(real, backward)
        ordered = attention(*(in_order(t, order) for t in (q_half, k_half, v_half)), True, None, dropout)
        out.append(in_order(ordered, order.argsort(dim=1)))
    return torch.cat(out, dim=1)


class EncoderLayer(nn.Module):
    """The pre-norm encoder layer of ``nn.TransformerEncoderLayer(norm_first=True, batch_first=True)``, with its
    parameter names and its creation order (a seed initializes it as
    it did), its attention in memory linear in the chunks (``attention``: no n x n tensor; an hour of video is
    11,250 chunks), its dropouts where they were: on the attention probabilities, the residuals and the
    feed-forward."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.self_attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)  # in_proj_*, out_proj
        self.linear1 = nn.Linear(width, 2 * width)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(2 * width, width)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, real: torch.Tensor | None, directional: bool) -> torch.Tensor:
        """``real`` [B, n]: each clip's real chunks (None: all)."""
        x = x + self.dropout1(self._attend(self.norm1(x), real, directional))
        return x + self.dropout2(self.linear2(self.dropout(F.relu(self.linear1(self.norm2(x))))))

    def _attend(self, x: torch.Tensor, real: torch.Tensor | None, directional: bool) -> torch.Tensor:
        batch, n, width = x.shape
        attn = self.self_attn
        q, k, v = (
            F.linear(x, attn.in_proj_weight, attn.in_proj_bias)
            .view(batch, n, 3, self.heads, width // self.heads)
            .permute(2, 0, 3, 1, 4)
        )  # each [B, H, n, d]
        dropout = attn.dropout if self.training else 0.0
        if directional:
            out = directional_attention(q, k, v, real, dropout)
        else:  # every chunk sees every real chunk
            out = attention(q, k, v, False, real, dropout)
        return attn.out_proj(out.transpose(1, 2).reshape(batch, n, width))


class Encoder(nn.Module):
    """``nn.TransformerEncoder``'s stack (its ``layers.N.*`` names; every layer starts as a copy of the first, as
    there) of EncoderLayer."""

    def __init__(self, layer: EncoderLayer, count: int):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(count))

    def forward(self, x: torch.Tensor, real: torch.Tensor | None, directional: bool) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, real, directional)
        return x
