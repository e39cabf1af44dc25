"""The one chunked forward, shared by train.py's validation, eval.py and infer_chunked.py.

A clip of T frames goes through the model in inference chunks of ``chunk_size`` frames that share
``overlap`` frames; the last chunk is aligned to the clip's end so every chunk is full length. The chunk
logits are aggregated: mean, max, last (only the last chunk is computed) or prob (mean of softmax
probabilities, returned as log-probabilities so argmax and softmax still apply). ``chunk_size`` -1, or
>= T, is exactly the plain forward.
"""
from __future__ import annotations

import torch

from datasets.windows import split_into_windows

AGGREGATIONS = ("mean", "max", "last", "prob")
TIME_AXIS = {"video": -3, "kpt": 1}  # video [B, (V,) C, T, H, W]; kpt [B, T, J, C]


def inference_windows(length: int, chunk_size: int, overlap: int, aggregation: str) -> list[tuple[int, int]]:
    windows = split_into_windows(length, chunk_size, overlap, align_last_to_end=True)
    return windows[-1:] if aggregation == "last" else windows


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
    """Running aggregation of window logits [n, B, K] into [B, K]; holds one [B, K] state, not all windows."""

    def __init__(self, aggregation: str):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation '{aggregation}'; expected one of {', '.join(AGGREGATIONS)}")
        self.aggregation = aggregation
        self.state: torch.Tensor | None = None
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
        if self.state is None or self.aggregation == "last":
            self.state = part
        elif self.aggregation == "max":
            self.state = torch.maximum(self.state, part)
        else:
            self.state = self.state + part
        self.count += logits.shape[0]

    def result(self) -> torch.Tensor:
        if self.state is None:
            raise ValueError("no window was aggregated")
        if self.aggregation == "mean":
            return self.state / self.count
        if self.aggregation == "prob":
            return (self.state / self.count).clamp_min(1e-12).log()
        return self.state


def forward_chunked(model, inputs: dict, chunk_size: int, overlap: int = 0, aggregation: str = "mean",
                    video_batch_size: int = 1, window_logits: list | None = None) -> torch.Tensor:
    """Logits [B, K] for clips longer than the model's memory allows in one pass.

    ``video_batch_size`` chunks go through one forward call (throughput versus memory). If
    ``window_logits`` is a list, each chunk's (start, end, logits on the CPU) is appended to it.
    """
    length = clip_length(inputs)
    min_frames = getattr(model, "min_frames", 1)
    if chunk_size == -1 or chunk_size >= length:
        logits = model(slice_time(inputs, 0, length, min_frames))
        if window_logits is not None:
            window_logits.append((0, length, logits.detach().float().cpu()))
        return logits
    windows = inference_windows(length, chunk_size, overlap, aggregation)
    aggregator = LogitAggregator(aggregation)
    for first in range(0, len(windows), video_batch_size):
        group = windows[first:first + video_batch_size]
        parts = [slice_time(inputs, s, e, min_frames) for s, e in group]
        stacked = {key: torch.cat([p[key] for p in parts]) for key in inputs}  # [n * B, ...]
        logits = model(stacked)
        logits = logits.view(len(group), -1, logits.shape[-1])  # [n, B, K]
        aggregator.update(logits)
        if window_logits is not None:
            for (s, e), chunk_logits in zip(group, logits.detach().float().cpu()):
                window_logits.append((s, e, chunk_logits))
    return aggregator.result()
