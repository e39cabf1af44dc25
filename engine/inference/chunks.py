"""The inference chunk runner: a clip through the model in inference chunks, shared by train.py's validation and
eval.py (``forward_chunked``: a clip in memory) and infer_chunked.py (``run_chunks``: chunks streamed from the
decoder); a clip's per-chunk labels.

A clip of T frames goes through the model in chunks of ``chunk_size`` frames that share ``overlap`` frames;
the last chunk is aligned to the clip's end so every chunk is full length (``chunk_windows``). The chunk
logits are aggregated: mean, max, last (only the last chunk is computed; evaluation only) or prob (mean of
softmax probabilities, returned as log-probabilities so argmax, softmax and the cross-entropy still apply).
``chunk_size`` -1, or >= T, is exactly the plain forward. The training forward is engine/training/chunked_forward.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from core.runtime import unwrap_model
from datasets.windows import chunk_windows, inference_windows
from models import temporal_head_of

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
        out[key] = _padded(tensor.narrow(axis, start, end - start), axis, min_frames)
    return out


def _padded(part: torch.Tensor, axis: int, min_frames: int) -> torch.Tensor:
    short = min_frames - part.shape[axis]
    if short <= 0:
        return part
    last = part.narrow(axis, part.shape[axis] - 1, 1)
    return torch.cat([part] + [last] * short, dim=axis)


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


class ChunkOutputs:
    """The model's outputs over a clip's inference chunks, gathered group by group (``add``) and made into the
    clip's (``result``): the one chunked forward of evaluation, for training's validation, eval.py
    (``forward_chunked``: the chunks are slices of a clip in memory) and infer_chunked.py (the chunks come from a
    decoding thread, ``ChunkStream``).

    Without a temporal head each group's logits are aggregated as they come (``aggregation``: mean, max, last or
    prob; one [B, K] state, whatever the video's length). With one, each chunk's features are kept (on the host with
    ``features_on_host``: 4 bytes x D a chunk) and the head runs once over them all at the end, so its per-chunk
    logits see context from both sides; ``frame_stride`` places the chunks in video frames."""

    def __init__(
        self,
        model,
        aggregation: str = "mean",
        frame_stride: int = 1,
        keep_features: bool = False,
        features_on_host: bool = False,
    ):
        self.model, self.head = model, temporal_head_of(model)
        self.frame_stride, self.keep_features, self.features_on_host = frame_stride, keep_features, features_on_host
        self.aggregator, self.chunk_logits, self.features, self.device = LogitAggregator(aggregation), [], [], None

    def add(self, group: list, stacked: dict) -> None:
        """The model on a group of chunks (``group``: their windows), their inputs stacked on the batch axis:
        [n * B, ...]."""
        self.device = next(iter(stacked.values())).device
        if self.head is not None or self.keep_features:
            chunk_features = self.model.features(stacked)  # [n * B, (V,) D]
            per_chunk = chunk_features.view(len(group), -1, *chunk_features.shape[1:])  # [n, B, (V,) D]
            self.features.append(per_chunk.float().cpu() if self.features_on_host else per_chunk)
        if self.head is None:
            logits = self.model.classify(chunk_features) if self.keep_features else self.model(stacked)
            logits = logits.view(len(group), -1, logits.shape[-1])  # [n, B, K]
            self.aggregator.update(logits)
            self.chunk_logits.append(logits.detach().float().cpu())

    def result(self, windows: list[tuple[int, int]]) -> ChunkedOutput:
        """The clip's logits from every chunk added (``windows``: all of them, in order)."""
        all_features = torch.cat(self.features).transpose(0, 1) if self.features else None  # [B, n, ...]
        if self.head is None:
            return ChunkedOutput(self.aggregator.result(), torch.cat(self.chunk_logits), all_features, windows)
        out = self.head(all_features.to(self.device), chunk_positions(windows, self.frame_stride))
        return ChunkedOutput(out.clip, out.chunks.detach().float().cpu().transpose(0, 1), all_features, windows)


def run_chunks(
    model,
    groups: Iterable[tuple[list, dict]],
    windows: list[tuple[int, int]],
    aggregation: str = "mean",
    frame_stride: int = 1,
    keep_features: bool = False,
    features_on_host: bool = False,
) -> ChunkedOutput:
    """``ChunkOutputs`` over ``groups`` (the group's windows, its inputs with the chunks stacked on the batch axis)
    in window order; ``windows`` are all of them."""
    outputs = ChunkOutputs(model, aggregation, frame_stride, keep_features, features_on_host)
    for group, stacked in groups:
        outputs.add(group, stacked)
    return outputs.result(windows)


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
