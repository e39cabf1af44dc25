"""Frames and keypoints of a clip, from open readers and a geometry: the one path from a file to model input,
used by the dataset (``VideoWindowDataset``) and by streaming inference (``datasets.chunk_stream.ChunkStream``).

Opening (which reader, at which decode size, random or sequential access) is the caller's; decoding and geometry
are here (MMAction2 separates ``DecordInit`` from ``DecordDecode`` the same way).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from datasets.clip_transform import ClipTransform, ViewGeometry
from datasets.keypoints import KeypointError, read_keypoints
from datasets.manifest import VideoRecord
from datasets.video.frame_reader import FrameReader


def read_clip(
    readers: Sequence[FrameReader],
    indices: Sequence[int],
    plans: Sequence[ViewGeometry],
    transform: ClipTransform,
    colour: tuple | None = None,
) -> list[torch.Tensor]:
    """Each view's frames at ``indices``.

    In: one reader per view, opened at its plan's ``decoded`` size; ``indices``: video frame numbers (any order,
    repeats allowed); ``plans``: each view's geometry (``ClipTransform.plan``); ``colour``: the sample's colour
    factors (training's jitter) or None.
    Out: per view, uint8 ``[C, T, H, W]`` (C = 3, RGB; T = len(indices); H, W = ``data.img_size``): cropped, and
    for training resized, flipped and colour-jittered.
    """
    return [
        transform.frames(torch.from_numpy(reader.read(indices)).permute(0, 3, 1, 2), plan, colour).permute(1, 0, 2, 3)
        for reader, plan in zip(readers, plans)
    ]


def read_clip_keypoints(
    record: VideoRecord, indices: Sequence[int], plans: Sequence[ViewGeometry], transform: ClipTransform
) -> np.ndarray:
    """The keypoints of ``indices`` (video frame numbers), following the first view's geometry.

    In: a record with ``keypoints`` (a file of [N, J, C] values, x and y first); ``plans`` empty when no frames
    are loaded (no geometry to follow). Out: float32 ``[T, J, C]``.
    """
    if record.keypoints is None:
        raise KeypointError(f"{record.where}: data.load_kpt is true but the sample has no 'keypoints'")
    kpt = read_keypoints(record.keypoints, indices)
    return transform.keypoints(kpt, plans[0]) if plans else kpt
