"""What a dataset sample holds, every key once: the video datasets', the features datasets' (a features file or an
MS-TCN dataset: one whole video a sample) and evaluation's streamed videos. Collated, each entry has the batch in
front ([B, ...]; a number becomes a tensor [B]); ``collate_features`` pads whole videos and adds ``mask``.
A sample is a dict, so the DataLoader collates and pins it as it is; this type says which keys it may have."""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import torch


class Sample(TypedDict, total=False):
    label: int  # the clip's class (its sample window's label; a mirrored clip of a class with a side, its mirror's)
    sample: int  # its index in the dataset: a feature bank's row, a resumed epoch's place
    video_index: int  # which video of the manifest
    window: torch.Tensor  # [2] the sample window [start, end) in the video's frames
    frame_indices: torch.Tensor  # [T] the video frames the clip decoded
    frame_labels: torch.Tensor  # [T] each of those frames' label (of the whole video for features), -1: none
    video: torch.Tensor  # uint8 [C, T, H, W], or [V, C, T, H, W] with several camera views
    kpt: torch.Tensor  # [T, J, 3] keypoints
    features: torch.Tensor  # [n, D] chunk features of a whole video (data.features_dir)
    windows: torch.Tensor  # [n, 2] each of those chunks' window in video frames
    chunk_labels: torch.Tensor  # [n] each chunk's label (the one covering most of its frames), -1: none
    mask: torch.Tensor  # [B, n] collated only: the real chunks of padded videos
    has_segments: bool  # its labels come from annotated segments (a timeline), not one label a video
    skipped: dict  # files skipped while loading it: {path: reason}; reported once, then removed
    notes: list  # a worker's one-time notes (a decoder chosen, ...); reported once, then removed


SAMPLE_KEYS = frozenset(Sample.__annotations__)


def whole_video_features(
    features: np.ndarray,
    windows: np.ndarray,
    chunk_labels: np.ndarray,
    frame_labels: np.ndarray,
    label: int,
    video_index: int,
    has_segments: bool,
) -> Sample:
    """The sample of one whole video's chunk features, from a features file or an MS-TCN dataset alike."""
    return {
        "features": torch.from_numpy(features),
        "windows": torch.from_numpy(windows).float(),
        "chunk_labels": torch.from_numpy(chunk_labels),
        "frame_labels": torch.from_numpy(frame_labels),
        "label": label,
        "video_index": video_index,
        "has_segments": has_segments,
    }
