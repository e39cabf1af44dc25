"""The one chunked forward: training (``ChunkedTrainingForward``), and evaluation (``run_chunks``), shared by
train.py's validation and eval.py (``forward_chunked``: a clip in memory) and infer_chunked.py (chunks streamed
from the decoder).

A clip of T frames goes through the model in chunks of ``chunk_size`` frames that share ``overlap`` frames;
the last chunk is aligned to the clip's end so every chunk is full length (``chunk_windows``). The chunk
logits are aggregated: mean, max, last (only the last chunk is computed; evaluation only) or prob (mean of
softmax probabilities, returned as log-probabilities so argmax, softmax and the cross-entropy still apply).
``chunk_size`` -1, or >= T, is exactly the plain forward.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from core.runtime import unwrap_model
from datasets.windows import chunk_windows, inference_windows
from models import temporal_head_of
from models.classifier import recompute_in_backward
from models.reconstruction import chunk_thumbnail
from models.temporal import HeadOutput

AGGREGATIONS = ("mean", "max", "last", "prob")
TIME_AXIS = {"video": -3, "kpt": 1, "features": 1}  # video [B, (V,) C, T, H, W]; kpt [B, T, J, C]; features [B, n, D]


def clip_length(inputs: dict) -> int:
    key = next(k for k in TIME_AXIS if k in inputs)
    return inputs[key].shape[TIME_AXIS[key]]


def slice_time(inputs: dict, start: int, end: int, min_frames: int = 1) -> dict:
    """The window [start, end) of every input; padded by repeating the last frame up to ``min_frames``."""
    out = {}
    for key, tensor in inputs.items():
        axis = TIME_AXIS[key] % tensor.dim()
        part = tensor.narrow(axis, start, end - start)
        if end - start < min_frames:
            last = part.narrow(axis, part.shape[axis] - 1, 1)
            part = torch.cat([part] + [last] * (min_frames - (end - start)), dim=axis)
        out[key] = part
    return out


class LogitAggregator:
    """Running aggregation of window logits [n, B, K] into [B, K]; holds one running [B, K], not all windows."""

    def __init__(self, aggregation: str):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation '{aggregation}'; expected one of {', '.join(AGGREGATIONS)}")
        self.aggregation = aggregation
        self.running: torch.Tensor | None = None
        self.count = 0

    def update(self, logits: torch.Tensor) -> None:
        logits = logits.float()
        if self.aggregation == "prob":
            part = logits.softmax(dim=-1).sum(dim=0)
        elif self.aggregation == "max":
            part = logits.max(dim=0).values
        elif self.aggregation == "last":
            part = logits[-1]
        else:
            part = logits.sum(dim=0)
        if self.running is None or self.aggregation == "last":
            self.running = part
        elif self.aggregation == "max":
            self.running = torch.maximum(self.running, part)
        else:
            self.running = self.running + part
        self.count += logits.shape[0]

    def result(self) -> torch.Tensor:
        if self.running is None:
            raise ValueError("no window was aggregated")
        if self.aggregation == "mean":
            return self.running / self.count
        if self.aggregation == "prob":
            return (self.running / self.count).clamp_min(1e-12).log()
        return self.running


def chunk_positions(windows: list[tuple[int, int]], frame_stride: int = 1) -> torch.Tensor:
    """[n, 2] each chunk's [start, end) in video frames from the clip's first frame (clip frame i is video frame
    i * frame_stride): the positions the temporal head encodes."""
    return torch.tensor(
        [[start * frame_stride, (end - 1) * frame_stride + 1] for start, end in windows], dtype=torch.float32
    )


@dataclass
class ChunkedOutput:
    """What evaluation's chunked forward gives (``run_chunks``, ``forward_chunked``): ``logits`` [B, K] of the
    clip; ``chunk_logits`` [n, B, K] on the CPU, each chunk's (the head's per-chunk outputs with a temporal head);
    ``features`` [B, n, ...] of each chunk (with a head, or when asked for; None otherwise); ``windows``: each
    chunk's [start, end) (clip frames; video frames for a head over features)."""

    logits: torch.Tensor
    chunk_logits: torch.Tensor
    features: torch.Tensor | None
    windows: list


def run_chunks(
    model,
    groups: Iterable[tuple[list, dict]],
    windows: list[tuple[int, int]],
    aggregation: str = "mean",
    frame_stride: int = 1,
    keep_features: bool = False,
    features_on_host: bool = False,
) -> ChunkedOutput:
    """The one chunked forward of evaluation: training's validation, eval.py (``forward_chunked``: the chunks are
    slices of a clip in memory) and infer_chunked.py (the chunks come from a decoding thread, ``ChunkStream``).

    ``groups`` yields (the group's windows, its inputs with the chunks stacked on the batch axis: [n * B, ...]) in
    window order; ``windows`` are all of them. Without a temporal head each group's logits are aggregated as they
    come (one [B, K] state). With one, each chunk's features are kept (on the host with ``features_on_host``: 4
    bytes x D a chunk, whatever the video's length) and the head runs once over them all at the end, so its
    per-chunk logits see context from both sides; ``frame_stride`` places the chunks in video frames."""
    head = temporal_head_of(model)
    aggregator, chunk_logits, features, device = LogitAggregator(aggregation), [], [], None
    for group, stacked in groups:
        device = next(iter(stacked.values())).device
        if head is not None or keep_features:
            chunk_features = model.features(stacked)  # [n * B, (V,) D]
            per_chunk = chunk_features.view(len(group), -1, *chunk_features.shape[1:])  # [n, B, (V,) D]
            features.append(per_chunk.float().cpu() if features_on_host else per_chunk)
        if head is None:
            logits = model.head(chunk_features) if keep_features else model(stacked)
            logits = logits.view(len(group), -1, logits.shape[-1])  # [n, B, K]
            aggregator.update(logits)
            chunk_logits.append(logits.detach().float().cpu())
    all_features = torch.cat(features).transpose(0, 1) if features else None  # [B, n, ...]
    if head is None:
        return ChunkedOutput(aggregator.result(), torch.cat(chunk_logits), all_features, windows)
    out = head(all_features.to(device), chunk_positions(windows, frame_stride))
    return ChunkedOutput(out.clip, out.chunks.detach().float().cpu().transpose(0, 1), all_features, windows)


def forward_chunked(
    model,
    inputs: dict,
    chunk_size: int,
    overlap: int = 0,
    aggregation: str = "mean",
    chunks_per_forward: int = 1,
    frame_stride: int = 1,
) -> ChunkedOutput:
    """Clips in memory, longer than the model's memory allows in one pass, through ``run_chunks``: their logits
    [B, K] and each inference chunk's.

    ``chunks_per_forward`` chunks go through one forward call (throughput versus memory). A model with a temporal
    head (``model.temporal``) runs its backbone chunk by chunk and the head once over all chunk features
    (``aggregation`` is the head's then; ``frame_stride`` places the chunks in video frames).
    """
    if "features" in inputs:  # a temporal head over features read from files (data.features_dir)
        return forward_features(model, inputs)
    length = clip_length(inputs)
    min_frames = getattr(model, "min_frames", 1)
    has_head = temporal_head_of(model) is not None
    if not has_head and (chunk_size == -1 or chunk_size >= length):  # exactly the plain forward
        logits = model(slice_time(inputs, 0, length, min_frames))
        return ChunkedOutput(logits, logits.detach().float().cpu()[None], None, [(0, length)])
    windows = (
        chunk_windows(length, chunk_size, overlap)
        if has_head
        else inference_windows(length, chunk_size, overlap, aggregation)
    )

    def groups():
        for first in range(0, len(windows), chunks_per_forward):
            group = windows[first : first + chunks_per_forward]
            parts = [slice_time(inputs, s, e, min_frames) for s, e in group]
            yield group, {key: torch.cat([p[key] for p in parts]) for key in inputs}  # [n * B, ...]

    return run_chunks(model, groups(), windows, aggregation, frame_stride)


def forward_features(model, inputs: dict) -> ChunkedOutput:
    """A temporal head over chunk features ({"features" [B, n, D], "windows" [B, n, 2] in video frames, "mask"
    [B, n]}): its clip logits, and each chunk's with the first sample's windows (evaluation runs one whole video a
    batch)."""
    out = unwrap_model(model)(inputs["features"], inputs["windows"], inputs.get("mask"))
    n = int(inputs["mask"][0].sum()) if "mask" in inputs else out.chunks.shape[1]
    windows = [tuple(w) for w in inputs["windows"][0, :n].long().tolist()]
    return ChunkedOutput(out.clip, out.chunks[:, :n].detach().float().cpu().transpose(0, 1), None, windows)


# ---------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class ChunkSpec:
    """How a training clip goes through the model: ``size`` frames per chunk (-1: the whole clip in one
    forward), ``overlap`` frames shared by neighbours, and which chunks' activations are recomputed in backward:
    all but the last ``kept`` (train.recompute: auto, the planner's count), none with ``recompute`` False (to
    compare gradients in the tests).

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
    The last ``spec.kept`` chunks keep their activations instead (train.recompute: auto, as many as the memory
    budget holds): no second forward for them.
    The inputs come as uint8 and are normalized per chunk inside the recomputed function (a float copy of a
    1,000-frame clip would be 4x the uint8 one). A clip in one chunk is exactly the plain training forward.

    With ``model.chunk_reconstruction`` the classifier's decoder predicts each chunk's thumbnail from its features
    (models/reconstruction.py): its weighted loss is the output's ``auxiliary``, which the training loss adds.

    The classifier is ``self.module``, which ``unwrap_model`` follows, so checkpoints hold the classifier's state
    dict alone. Under torchrun no collective runs inside it (``engine.oom.agree_and_reduce`` averages gradients).
    """

    def __init__(self, module: nn.Module, normalize, frame_stride: int = 1):
        super().__init__()
        self.module = module
        self.normalize = normalize
        self.frame_stride = frame_stride  # clip frame i is video frame i * frame_stride (the head's positions)

    def forward(self, inputs: dict, spec: ChunkSpec, bank=None, samples: torch.Tensor | None = None) -> HeadOutput:
        """``bank`` (train.feature_bank, an ``engine.feature_bank.FeatureBank``) and ``samples`` (the clips' indices
        in the training set): the chunks without a gradient are read from the bank where it has them."""
        windows = chunk_windows(clip_length(inputs), spec.size, spec.overlap)
        head = temporal_head_of(self.module)
        if head is None and len(windows) == 1:
            return HeadOutput(None, self.module(self.normalize(inputs)).unsqueeze(1))
        if bank is not None and not bank.follows(windows):
            bank.regrid(windows, f"training chunks of {spec.size} frames")
        outputs = self._chunk_outputs(inputs, windows, spec, head is not None, bank, samples)
        if head is None:
            return HeadOutput(None, torch.stack(outputs, dim=1))
        features = torch.stack(outputs, dim=1)
        out = head(features, chunk_positions(windows, self.frame_stride))
        decoder = getattr(unwrap_model(self.module), "reconstruction", None)
        if decoder is None or not torch.is_grad_enabled():
            return out
        thumbnails = torch.stack(
            [chunk_thumbnail(slice_time(inputs, start, end)["video"]) for start, end in windows], 1
        )
        return out._replace(auxiliary=decoder(features, thumbnails))

    def _recomputed(self, spec: ChunkSpec, chunk: int, chunks: int) -> bool:
        # a frozen backbone (model.freeze_backbone) runs without a graph: nothing of it to recompute, and
        # recomputing the chunk would run it twice for the head's or classifier's few activations
        return spec.recomputed(chunk, chunks) and not getattr(unwrap_model(self.module), "frozen_backbone", False)

    def _chunk_logits(self, chunk: dict) -> torch.Tensor:
        return self.module(self.normalize(chunk))

    def _chunk_features(self, chunk: dict) -> torch.Tensor:
        return self.module.features(self.normalize(chunk))

    def _chunk_outputs(
        self, inputs: dict, windows: list, spec: ChunkSpec, features: bool, bank=None, samples=None
    ) -> list[torch.Tensor]:
        """Each chunk's logits, or its features for the temporal head (then only the [B, n, D] features and the
        head's own activations stay alive). A chunk with a graph is recomputed in backward unless it is among
        the last ``spec.kept`` of them: one chunk's activations alive at a time. With train.grad_chunks the
        others run without a graph (train-mode BatchNorm, as every chunk) and enter detached, or come from the
        bank when it holds them for every clip of the batch (each chunk computed is written to it)."""
        min_frames = getattr(unwrap_model(self.module), "min_frames", 1)
        function = self._chunk_features if features else self._chunk_logits
        graph = spec.graph_chunks(len(windows))
        with_graph = range(len(windows)) if graph is None else sorted(graph)
        order = {chunk: rank for rank, chunk in enumerate(with_graph)}  # its place among the chunks with a graph
        outputs, from_bank = [], []
        for i, (start, end) in enumerate(windows):
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

    def forward(self, inputs: dict, spec: ChunkSpec) -> HeadOutput:
        return self.module(inputs["features"], inputs["windows"], inputs["mask"])


def aggregate_chunk_logits(chunk_logits: torch.Tensor, aggregation: str) -> torch.Tensor:
    """[n, B, K] -> [B, K], differentiable; the same arithmetic as evaluation's aggregation."""
    aggregator = LogitAggregator(aggregation)
    aggregator.update(chunk_logits)
    return aggregator.result()


def chunk_labels(frame_labels: torch.Tensor, windows: list[tuple[int, int]]) -> torch.Tensor:
    """[n, B]: each chunk's label is the one covering most of its frames (frame label -1: no segment; ties go
    to the lower class index); -1 where no frame of the chunk is labelled."""
    labels = torch.full((len(windows), frame_labels.shape[0]), -1, dtype=torch.long)
    for i, (start, end) in enumerate(windows):
        for b, row in enumerate(frame_labels[:, start:end]):
            covered = row[row >= 0]
            if len(covered):
                labels[i, b] = int(torch.bincount(covered).argmax())
    return labels
