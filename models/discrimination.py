"""Chunk discrimination (``model.chunk_discrimination``): an auxiliary loss that keeps each training chunk's features
apart from the other chunks' by whatever the chunk holds (a colour, a direction of motion, a texture, a rhythm),
where the label alone does not ask for it.

A label that relates far events (was the second attempt like the first) is the same when the events' kinds are
swapped, so it gives a backbone that trains no reason to tell those kinds apart, and what it learns meanwhile can
merge them (models/reconstruction.py says more). The chunk reconstruction keeps them apart by predicting a
thumbnail, so only by what the thumbnail holds; this loss asks nothing of the pixels: each chunk is computed twice
more, from its even frames and from its odd frames (the same moment at half the frame rate, no pixel in common),
and among all the chunks of the micro-batch each one's even-frame features must lie nearest to its own odd-frame
features, and the other way round (InfoNCE, the loss of SimCLR and MoCo, here without a projection: the features
it shapes are the ones the temporal head reads). Two chunks can only be told apart by what differs between them,
so whatever differs between kinds of event is kept, in any modality.

The cost: two forwards of half a chunk for each chunk with a gradient, and their backward; they are recomputed in
backward with the chunk, and the memory planner counts them (it runs this forward).
Their BatchNorm layers normalize with their own batch statistics and leave the running statistics to the whole
chunk's forward (the halves run at half the frame rate). The other chunks of the micro-batch are the negatives:
under torchrun each rank's own (no collective runs in the forward). A micro-batch of one chunk has no negative:
its loss is zero.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def pair_discrimination(first: torch.Tensor, second: torch.Tensor, temperature: float) -> torch.Tensor:
    """InfoNCE of M pairs ``first[i]``, ``second[i]`` ([M, D] each): the cross-entropy of finding each row's pair
    among all M rows of the other by cosine similarity over ``temperature``, both ways, averaged."""
    first, second = F.normalize(first.float(), dim=-1), F.normalize(second.float(), dim=-1)
    logits = first @ second.T / temperature
    target = torch.arange(len(first), device=first.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


class ChunkDiscrimination(nn.Module):
    """The loss of the module docstring: its weight and temperature (no parameters)."""

    def __init__(self, weight: float, temperature: float):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"the chunk discrimination's temperature must be above 0, not {temperature}")
        self.weight, self.temperature = weight, temperature

    def forward(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The weighted loss of each chunk's even- and odd-frame features ([B, D] each, one pair a chunk)."""
        first = torch.cat([even for even, _ in pairs])
        second = torch.cat([odd for _, odd in pairs])
        return self.weight * pair_discrimination(first, second, self.temperature)

    def extra_repr(self) -> str:
        return f"weight={self.weight}, temperature={self.temperature}"
