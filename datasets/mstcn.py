"""MS-TCN's layout of a temporal action segmentation dataset, read in place (``data.features_format: mstcn``) and
written (``infer_chunked.py --features DIR --features-layout mstcn``).

It is how MS-TCN distributes Breakfast, 50Salads and GTEA, and what every paper since (ASFormer, DiffAct,
LTContext, FACT) trains and reports on:

    ROOT/features/NAME.npy                       float32 [D, T]: a feature vector a frame
    ROOT/groundTruth/NAME.txt                    a label a line, a line a frame
    ROOT/mapping.txt                             "index label" a line: the classes, by index
    ROOT/splits/train.splitN.bundle              a groundTruth file name a line: split N's training videos
    ROOT/splits/test.splitN.bundle               ... and its test videos

Read as MS-TCN's ``batch_gen.py`` reads it: a video's training sequence is ``features[:, ::sample_rate]`` with
``labels[::sample_rate]`` (``data.frame_stride`` is the sample rate: 2 for 50Salads' 30 fps features, as MS-TCN
trains), and a prediction stands for the ``sample_rate`` frames from its own, so the scores count every frame of
the ground truth, as MS-TCN's ``eval.py`` does. Where MS-TCN's loader cuts a ground truth and its features to the
shorter of the two, this one refuses a pair that differ: the distributed sets have one label a feature frame, and
a mismatch means a file from another extraction.
"""

from __future__ import annotations

import glob
import os
import re

import numpy as np
from torch.utils.data import Dataset

from core.files import atomic_open, atomic_write_bytes
from datasets.manifest import ManifestError
from datasets.sample import Sample, whole_video_features

BACKGROUND = "background"  # the label MS-TCN's eval.py leaves out of edit and F1 (its bg_class)


def read_mapping(root: str) -> list[str]:
    """The class names of mapping.txt in index order; indices must be 0 .. K-1, each once."""
    path = os.path.join(root, "mapping.txt")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ManifestError(f"{path}: cannot be read ({e.strerror}); an MS-TCN dataset root has mapping.txt")
    names: dict[int, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit():
            raise ManifestError(f"{path} line {number}: {line!r} is not 'index label' (e.g. '0 background')")
        index, name = int(parts[0]), parts[1]
        if index in names or name in names.values():
            raise ManifestError(f"{path} line {number}: {line!r} repeats an index or a label of an earlier line")
        names[index] = name
    if sorted(names) != list(range(len(names))) or not names:
        raise ManifestError(f"{path}: the indices must be 0 to {len(names) - 1}, each once (got {sorted(names)})")
    return [names[i] for i in range(len(names))]


def split_numbers(root: str) -> list[int]:
    """The split numbers N of ROOT/splits/train.splitN.bundle, ascending."""
    found = glob.glob(os.path.join(root, "splits", "train.split*.bundle"))
    return sorted(int(m.group(1)) for m in (re.search(r"train\.split(\d+)\.bundle$", p) for p in found) if m)


def bundle_names(root: str, part: str, split: int) -> list[str]:
    """The video names (groundTruth file names without .txt) of splits/{part}.split{split}.bundle, each with its
    ground truth and features checked to exist."""
    path = os.path.join(root, "splits", f"{part}.split{split}.bundle")
    if not os.path.exists(path):
        have = split_numbers(root)
        raise ManifestError(
            f"{path}: no such bundle; data.features_split names one of the splits there "
            f"({', '.join(map(str, have)) if have else f'none: {root}/splits/ has no train.splitN.bundle'})"
        )
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    names = []
    for number, line in enumerate(lines, 1):
        entry = line.strip()
        if not entry:
            continue
        name = entry[: -len(".txt")] if entry.endswith(".txt") else entry
        for kind, file in (("groundTruth", f"{name}.txt"), ("features", f"{name}.npy")):
            if not os.path.exists(os.path.join(root, kind, file)):
                raise ManifestError(
                    f"{path} line {number}: {entry!r} has no {os.path.join(root, kind, file)}; "
                    f"correct the line or add the file"
                )
        names.append(name)
    if not names:
        raise ManifestError(f"{path}: no videos listed; a bundle has a groundTruth file name a line")
    return names


def read_ground_truth(root: str, name: str, class_index: dict[str, int]) -> np.ndarray:
    """groundTruth/NAME.txt as class indices [T] int64."""
    path = os.path.join(root, "groundTruth", f"{name}.txt")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()  # Windows line ends too
    while lines and not lines[-1].strip():  # blank lines at the end, as some distributed files have
        lines.pop()
    labels = np.empty(len(lines), dtype=np.int64)
    for number, line in enumerate(lines, 1):
        index = class_index.get(line.strip())
        if index is None:
            raise ManifestError(
                f"{path} line {number}: label {line.strip()!r} is not in {os.path.join(root, 'mapping.txt')}; "
                f"add it there or correct the line"
            )
        labels[number - 1] = index
    return labels


def feature_shape(root: str, name: str) -> tuple[int, int]:
    """(D, T) of features/NAME.npy, from its header alone."""
    path = os.path.join(root, "features", f"{name}.npy")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: not a .npy array ({e}); MS-TCN's features are float32 [D, T] a video")
    if array.ndim != 2:
        raise ManifestError(f"{path}: shape {tuple(array.shape)}; MS-TCN's features are [D, T] (2-D) a video")
    return int(array.shape[0]), int(array.shape[1])


class MsTcnVideos(Dataset):
    """The videos of one bundle as samples of engine.data.feature_files's shape: a whole video's features every
    ``sample_rate``-th frame ([n, D]), each standing for the window [i * sample_rate, (i + 1) * sample_rate) of
    frames, its label the window's first frame's (``labels[::sample_rate]``, as MS-TCN trains), and every frame's
    label for the scores. Ground truths are read and checked when the set is made: a broken file stops the run
    before its first step, not in its tenth epoch."""

    def __init__(self, root: str, names: list[str], class_names: list[str], sample_rate: int):
        self.root, self.names, self.class_names, self.sample_rate = root, names, class_names, sample_rate
        index = {name: i for i, name in enumerate(class_names)}
        self.labels = []
        for name in names:
            _, frames = feature_shape(root, name)
            labels = read_ground_truth(root, name, index)
            if len(labels) != frames:
                raise ManifestError(
                    f"{os.path.join(root, 'groundTruth', name + '.txt')}: {len(labels)} lines for the {frames} "
                    f"frames of {os.path.join(root, 'features', name + '.npy')}; the layout has one label a "
                    f"feature frame (a file from another extraction?)"
                )
            self.labels.append(labels)
        self.records = names  # the evaluation rows' video names
        self.stall_folder = None  # no decoding: no sample deadline

    def __len__(self) -> int:
        return len(self.names)

    def set_epoch(self, epoch: int) -> None:  # no augmentation: every epoch reads the same features
        pass

    def chunks(self, index: int) -> int:
        """The length of a video's training sequence: its frames every ``sample_rate``-th."""
        return -(-len(self.labels[index]) // self.sample_rate)

    def __getitem__(self, index: int) -> Sample:
        features = np.load(os.path.join(self.root, "features", f"{self.names[index]}.npy"), allow_pickle=False)
        frames = self.labels[index]
        starts = np.arange(0, len(frames), self.sample_rate)
        windows = np.stack([starts, np.minimum(starts + self.sample_rate, len(frames))], axis=1)
        return whole_video_features(
            np.ascontiguousarray(features[:, :: self.sample_rate].T, np.float32),
            windows,
            frames[:: self.sample_rate].copy(),
            frames,
            int(np.bincount(frames).argmax()) if len(frames) else 0,
            index,
            has_segments=True,
        )


def write_video(root: str, name: str, features: np.ndarray, labels: list[str] | None) -> None:
    """One video in the layout, atomically: features/NAME.npy [D, n] float32 from ``features`` [n, D], and
    groundTruth/NAME.txt (a label a line) where ``labels`` are given."""
    os.makedirs(os.path.join(root, "features"), exist_ok=True)
    with atomic_open(os.path.join(root, "features", f"{name}.npy")) as f:
        np.save(f, np.ascontiguousarray(np.asarray(features, dtype=np.float32).T))
    if labels is not None:
        os.makedirs(os.path.join(root, "groundTruth"), exist_ok=True)
        with atomic_open(os.path.join(root, "groundTruth", f"{name}.txt")) as f:
            f.write("".join(f"{label}\n" for label in labels).encode())


def check_one_word(class_names: list[str]) -> None:
    """MS-TCN's loaders split mapping.txt's lines on white space: a label must be one word."""
    spaced = [name for name in class_names if not name or any(c.isspace() for c in name)]
    if spaced:
        raise ManifestError(
            f"class {spaced[0]!r}: MS-TCN's mapping.txt splits a line on white space, so a label must be one word; "
            f"rename the class (e.g. with _ for spaces)"
        )


def write_index(root: str, class_names: list[str] | None, bundles: dict[str, list[str]]) -> None:
    """mapping.txt ("index label" a line; none for ``class_names`` None) and splits/<bundle>.bundle (a groundTruth
    file name a line), atomically."""
    os.makedirs(os.path.join(root, "splits"), exist_ok=True)
    for bundle, names in bundles.items():
        text = "".join(f"{name}.txt\n" for name in names)
        atomic_write_bytes(os.path.join(root, "splits", f"{bundle}.bundle"), text.encode())
    if class_names is None:
        return
    check_one_word(class_names)
    atomic_write_bytes(
        os.path.join(root, "mapping.txt"), "".join(f"{i} {n}\n" for i, n in enumerate(class_names)).encode()
    )
