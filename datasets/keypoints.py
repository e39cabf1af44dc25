"""Per-frame keypoints: a directory of ``NNNNNN_<name>.npz`` files or one [T, J, C] array; only asked frames load."""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np


class KeypointError(Exception):
    """Keypoints that cannot be loaded; the message names the file or directory."""


@lru_cache(maxsize=64)
def _frame_files(directory: str) -> dict[int, str]:
    """Global frame index -> file name, for a directory of NNNNNN_<name>.npz files (listed once per worker)."""
    if not os.path.isdir(directory):
        raise KeypointError(f"{directory}: keypoint directory not found")
    files = {}
    for name in os.listdir(directory):
        head = name.split("_", 1)[0]
        if name.endswith((".npz", ".npy")) and head.isdigit():
            files[int(head)] = name
    if not files:
        raise KeypointError(f"{directory}: no keypoint files named NNNNNN_<name>.npz")
    return files


def _first_array(path: str) -> np.ndarray:
    data = np.load(path, allow_pickle=False)
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            key = "keypoints" if "keypoints" in data.files else data.files[0]
            return data[key]
    return data


def read_keypoints(path: str, indices) -> np.ndarray:
    """Keypoints of the frames ``indices`` as float32 [N, J, C]."""
    indices = np.asarray(indices, dtype=np.int64)
    if os.path.isdir(path):
        files = _frame_files(path)
        missing = [int(i) for i in indices if int(i) not in files]
        if missing:
            raise KeypointError(
                f"{path}: keypoint files missing for frames {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''} (expected NNNNNN_<name>.npz per frame)"
            )
        frames = [_first_array(os.path.join(path, files[int(i)])) for i in indices]
        shapes = {f.shape for f in frames}
        if len(shapes) != 1:
            raise KeypointError(f"{path}: keypoint files of different shapes {sorted(shapes)}")
        return np.stack(frames).astype(np.float32)
    if not os.path.exists(path):
        raise KeypointError(f"{path}: keypoint file not found")
    array = np.load(path, mmap_mode="r", allow_pickle=False) if path.endswith(".npy") else _first_array(path)
    if array.ndim != 3:
        raise KeypointError(f"{path}: keypoints must be an array [T, J, C], got shape {array.shape}")
    if indices.size and indices.max() >= array.shape[0]:
        raise KeypointError(f"{path}: has keypoints for {array.shape[0]} frames, frame {int(indices.max())} asked")
    return np.asarray(array[indices], dtype=np.float32)


def keypoint_length(path: str) -> int:
    """Number of frames with keypoints (for a directory: the highest frame index + 1)."""
    if os.path.isdir(path):
        return max(_frame_files(path)) + 1
    if not os.path.exists(path):
        raise KeypointError(f"{path}: keypoint file not found")
    array = np.load(path, mmap_mode="r", allow_pickle=False) if path.endswith(".npy") else _first_array(path)
    return int(array.shape[0])
