"""The training forward in training chunks (``ChunkedTrainingForward``; ``FeatureHeadForward`` for a head on
feature files): which chunks are recomputed in backward and which carry a gradient (``ChunkSpec``). The chunks
are cut as the inference chunk runner cuts them (engine/inference/chunks.py).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch
from torch import nn

from core.runtime import unwrap_model
from datasets.windows import chunk_windows
from engine.inference.chunks import chunk_positions, clip_length, slice_time
from models import temporal_head_of
from models.classifier import recompute_in_backward
from models.temporal import HeadOutput


@dataclass(frozen=True)
class ChunkSpec:
    """How a training clip goes through the model: ``size`` frames per chunk (-1: the whole clip in one
    forward), ``overlap`` frames shared by neighbours, and which chunks' activations are recomputed in backward:
    all but the last ``kept`` (as many as the memory budget holds: the planner's count), none with ``recompute``
    False (to compare gradients in the tests).

    ``grad_chunks`` (train.grad_chunks; 0: all): only that many chunks of the clip carry a gradient, one drawn
    from each of ``grad_chunks`` equal strata of the clip (``draw`` seeds the draw: the step's, so a resumed run
    draws the same chunks); the others run forward without a graph. ``kept`` and ``recomputed`` then count the
    chunks with a graph only."""

    size: int = -1
    overlap: int = 0
    recompute: bool = True
    kept: int = 0
    grad_chunks: int = 0
    draw: int = 0

    def recomputed(self, chunk: int, chunks: int) -> bool:
        """Is chunk ``chunk`` of ``chunks`` recomputed in backward? The kept ones are the last: backward reaches
        them first (autograd runs the latest nodes first) and frees their activations before it recomputes the
        others, so the peak holds ``kept`` chunks' activations or one recomputed chunk's, not both."""
        return self.recompute and chunks > 1 and chunk < chunks - self.kept

    def graph_chunks(self, chunks: int) -> dict[int, float] | None:
        """The chunks (of ``chunks``) whose forward builds a graph, each with the weight of its gradient; None:
        every chunk, weight 1. One chunk is drawn uniformly from each of ``grad_chunks`` strata of nearly equal
        size, and its gradient is multiplied by its stratum's size (the inverse of its chance to be drawn), so
        the backbone's gradient is on average the one of every chunk (Horvitz-Thompson) and every part of the
        clip is drawn across steps."""
        if self.grad_chunks <= 0 or self.grad_chunks >= chunks:
            return None
        generator = random.Random(self.draw)  # not torch's: the planner runs this under fake tensors
        bounds = [round(j * chunks / self.grad_chunks) for j in range(self.grad_chunks + 1)]
        drawn = {}
        for low, high in zip(bounds, bounds[1:]):
            drawn[generator.randrange(low, high)] = float(high - low)
        return drawn


def grad_chunks_of(setting: int | str) -> int:
    """train.grad_chunks as ChunkSpec.grad_chunks: 0 for all."""
    return 0 if setting == "all" else int(setting)


def seed_of(*key: int) -> int:
    """A seed from integers: the same on every machine and run (Python's hash of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def weighted_gradient(output: torch.Tensor, weight: float) -> torch.Tensor:
    """``output`` unchanged in value, its gradient multiplied by ``weight`` on the way back."""
    if weight == 1.0:
        return output
    return output.detach() + (output - output.detach()) * weight


class ChunkedTrainingForward(nn.Module):
    """The training forward: a ``HeadOutput`` of a clip's chunk logits ``[B, n, K]`` (n = 1 without chunking);
    with a temporal head also its clip logits [B, K] (and a tcn's stages), without one ``clip`` is None (the loss
    aggregates the chunks, train.chunk_train_aggregation).

    Each chunk's forward runs under non-reentrant checkpointing: between forward and backward only the chunk
    inputs (views of the uint8 clip, 1 byte a pixel) and the chunk logits stay alive, and in backward one
    chunk is recomputed at a time, so the activation memory is that of one chunk whatever the clip length.
    The last ``spec.kept`` chunks keep their activations instead (as many as the memory budget holds): no second
    forward for them.
    The inputs come as uint8 and are normalized per chunk inside the recomputed function (a float copy of a
    1,000-frame clip would be 4x the uint8 one). A clip in one chunk is exactly the plain training forward.

    With ``model.chunk_reconstruction`` the classifier's decoder predicts each chunk's thumbnail from its features
    (models/reconstruction.py): its weighted loss is the output's ``auxiliary``, which the training loss adds.

    ``bank`` (train.feature_bank, a ``feature_bank.FeatureBank``): the chunks without a gradient are read from it
    where it has them, by the clips' indices in the training set.

    The classifier is ``self.module``, which ``unwrap_model`` follows, so checkpoints hold the classifier's state
    dict alone. Under torchrun no collective runs inside it (``oom.agree_and_reduce`` averages gradients).
    """

    def __init__(self, module: nn.Module, normalize, frame_stride: int = 1, bank=None):
        super().__init__()
        self.module = module
        self.normalize = normalize
        self.frame_stride = frame_stride  # clip frame i is video frame i * frame_stride (the head's positions)
        self.bank = bank

    def forward(self, inputs: dict, spec: ChunkSpec, samples: torch.Tensor | None = None) -> HeadOutput:
        """``samples``: the clips' indices in the training set, which the bank reads by."""
        chunks = chunk_windows(clip_length(inputs), spec.size, spec.overlap)
        head = temporal_head_of(self.module)
        if head is None and len(chunks) == 1:
            return HeadOutput(None, self.module(self.normalize(inputs)).unsqueeze(1))
        bank = self.bank if samples is not None else None
        if bank is not None and not bank.follows(chunks):
            bank.regrid(chunks, f"training chunks of {spec.size} frames")
        outputs = self._chunk_outputs(inputs, chunks, spec, head is not None, bank, samples)
        if head is None:
            return HeadOutput(None, torch.stack(outputs, dim=1))
        features = torch.stack(outputs, dim=1)
        out = head(features, chunk_positions(chunks, self.frame_stride))
        decoder = getattr(unwrap_model(self.module), "reconstruction", None)
        if decoder is not None and torch.is_grad_enabled() and features.requires_grad:
            thumbnails = torch.stack(
                [decoder.thumbnail(slice_time(inputs, start, end)["video"]) for start, end in chunks], 1
            )
            return out._replace(auxiliary=decoder(features, thumbnails))
        return out

    def _recomputed(self, spec: ChunkSpec, chunk: int, chunks: int) -> bool:
        # a frozen backbone (model.freeze_backbone, side adapters) runs without a graph: nothing of it to recompute,
        # and recomputing the chunk would run it twice for the head's, classifier's or adapters' few activations
        return spec.recomputed(chunk, chunks) and not getattr(
            unwrap_model(self.module), "backbone_without_graph", False
        )

    def _chunk_logits(self, chunk: dict) -> torch.Tensor:
        return self.module(self.normalize(chunk))

    def _chunk_features(self, chunk: dict) -> torch.Tensor:
        return self.module.features(self.normalize(chunk))

    def _chunk_outputs(
        self, inputs: dict, chunks: list, spec: ChunkSpec, features: bool, bank=None, samples=None
    ) -> list[torch.Tensor]:
        """Each chunk's logits, or its features for the temporal head (then only the [B, n, D] features and the
        head's own activations stay alive). A chunk with a graph is recomputed in backward unless it is among
        the last ``spec.kept`` of them: one chunk's activations alive at a time. With train.grad_chunks the
        others run without a graph (train-mode BatchNorm, as every chunk) and enter detached, or come from the
        bank when it holds them for every clip of the batch (each chunk computed is written to it)."""
        min_frames = getattr(unwrap_model(self.module), "min_frames", 1)
        function = self._chunk_features if features else self._chunk_logits
        graph = spec.graph_chunks(len(chunks))
        with_graph = range(len(chunks)) if graph is None else sorted(graph)
        order = {chunk: rank for rank, chunk in enumerate(with_graph)}  # its place among the chunks with a graph
        outputs, from_bank = [], []
        for i, (start, end) in enumerate(chunks):
            if i not in order and bank is not None:
                kept = bank.read(samples, i)
                if kept is not None:
                    outputs.append(kept)
                    from_bank.append(i)
                    continue
            chunk = slice_time(inputs, start, end, min_frames)
            if i not in order:
                with torch.no_grad():
                    outputs.append(function(chunk))
            elif self._recomputed(spec, order[i], len(order)):
                outputs.append(recompute_in_backward(self.module, function, chunk))
            else:
                outputs.append(function(chunk))
            if bank is not None:
                bank.write(samples, i, outputs[-1])
            if graph is not None and i in graph:
                outputs[-1] = weighted_gradient(outputs[-1], graph[i])
        computed = outputs[next(i for i in range(len(outputs)) if i not in from_bank)]  # a drawn chunk at least
        for i in from_bank:
            outputs[i] = outputs[i].to(computed.device, computed.dtype, non_blocking=True)
        return outputs


class FeatureHeadForward(nn.Module):
    """The training forward over features (data.features_dir): the temporal head over whole videos' chunk features,
    padded to a batch; the same outputs as ChunkedTrainingForward with a head. No chunking, nothing recomputed: the
    backbone ran when the features were written."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, inputs: dict, spec: ChunkSpec, samples: torch.Tensor | None = None) -> HeadOutput:
        return self.module(inputs["features"], inputs["windows"], inputs["mask"])
