"""``infer_chunked.py --features DIR``: per-chunk backbone features of whole videos, for temporal localization
(ActionFormer, BMN, G-TAD and the like), streamed with the inference path, so memory stays flat in video length.

One ``DIR/<video stem>.npz`` per video (``<stem>-<8 hex>.npz`` when two inputs share a stem: the hex is of the
video's absolute path, decided over the whole input list so every shard names a file alike). It holds:

    features         [n, D] float16 (or float32)  each inference chunk's features after view fusion: what the
                                                   temporal head (or, without one, the classifier) takes in
    logits           [n, K] float32               each chunk's logits (with a temporal head: its per-chunk outputs)
    windows_frames   [n, 2] int64                 each chunk's [start, end) in video frames
    windows_seconds  [n, 2] float64               the same in seconds (frames / fps)
    fps, frame_stride, chunk, overlap, num_frames  scalars; view_fusion, temporal_head, video, class_names
    checkpoint_sha256, checkpoint (the backbone checkpoint's absolute path), config (the resolved YAML),
    settings (JSON: what decides the features)

``train.py`` with ``data.features_dir`` trains a temporal head on these files (engine/data/feature_files.py).

Files are written atomically. A video whose file exists with the same settings (checkpoint content, chunking,
stride, geometry, dtype) is skipped with one line; a file from other settings is recomputed, never mixed.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from config import Config, dump
from core.errors import UsageError
from core.files import atomic_open
from datasets.manifest import VideoRecord
from datasets.mstcn import BACKGROUND, write_index, write_video
from datasets.prepared_copies import PREPARED_CRF, PREPARED_GOP
from datasets.records import frame_labels, segment_frames
from engine.inference.chunks import chunk_labels
from engine.inference.video_result import VideoResult

FEATURE_DTYPES = ("float16", "float32")


FEATURE_LAYOUTS = ("npz", "mstcn", "both")


@dataclass(frozen=True)
class FeatureOutput:
    """--features DIR: where each video's file goes, what decides its content (``settings_of``: a file written
    with other settings is recomputed) and the checkpoint that writes it; ``layout``: this tool's files, MS-TCN's
    layout (``write_mstcn``) or both, and for MS-TCN's the bundle's name and every video of the input list."""

    directory: str
    settings: dict
    checkpoint: str
    layout: str = "npz"
    bundle: str = "videos"
    all_names: tuple = ()

    def done(self, name: str) -> str | None:
        """None when the video ``name`` has its files with these settings; else why it is (re)computed. MS-TCN's
        layout has no room for the settings: alone, every video is computed again."""
        if self.layout == "mstcn":
            return "MS-TCN's layout alone records no settings (--features-layout both skips done videos)"
        reason = done_before(os.path.join(self.directory, name), self.settings)
        if reason is None and self.layout == "both" and not os.path.exists(mstcn_features_path(self.directory, name)):
            return "no MS-TCN features file yet"
        return reason


def feature_names(records: list[VideoRecord]) -> list[str]:
    """The file name of each record's features, collision-safe over the whole input list."""
    stems = [os.path.splitext(os.path.basename(r.first_path))[0] for r in records]
    counts = Counter(stems)
    return [
        f"{stem}-{hashlib.sha1(os.path.abspath(r.first_path).encode()).hexdigest()[:8]}.npz"
        if counts[stem] > 1
        else f"{stem}.npz"
        for stem, r in zip(stems, records)
    ]


def make_features_directory(directory: str) -> None:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"--features {directory}: a file, not a directory; give a directory (created if missing)")
    os.makedirs(directory, exist_ok=True)


def settings_of(cfg: Config, chunk: int, overlap: int, dtype: str, checkpoint_sha256: str) -> dict:
    """What decides a video's features: a file with other settings is recomputed."""
    data, model = cfg.data, cfg.model
    # read from prepared copies, the frames differ from the sources' by the re-encode: said only then, so the
    # files written from the sources keep their settings
    prepared = {"prepared": {"gop": PREPARED_GOP, "crf": PREPARED_CRF}} if data.prepared_dir else {}
    return prepared | {
        "checkpoint_sha256": checkpoint_sha256,
        "chunk": chunk,
        "overlap": overlap,
        "dtype": dtype,
        "frame_stride": data.frame_stride,
        "fps": data.fps,
        "img_size": data.img_size,
        "resize": data.resize,
        "short_side": data.short_side,
        "decoder": data.decoder,
        "view_fusion": model.view_fusion,
        "temporal_head": model.temporal_head,
    }


def done_before(path: str, settings: dict) -> str | None:
    """None when ``path`` holds this video's features with ``settings``; else why it is (re)computed."""
    if not os.path.exists(path):
        return "new"
    try:
        with np.load(path, allow_pickle=False) as saved:
            before = json.loads(str(saved["settings"]))
    except (OSError, ValueError, KeyError):
        return "the file there is not a features file of this tool"
    if before == settings:
        return None
    changed = sorted(k for k in settings if before.get(k) != settings[k])
    return f"written with other settings ({', '.join(changed)})"


def write_features(
    path: str,
    result: VideoResult,
    record: VideoRecord,
    cfg: Config,
    settings: dict,
    class_names: list[str],
    checkpoint: str = "",
) -> None:
    """``result``'s chunk features (classify_video with keep_features) as ``path``, atomically."""
    chunks = result.features
    frames = np.asarray(chunks.frame_windows, dtype=np.int64).reshape(-1, 2)
    arrays = {
        "features": chunks.features.astype(settings["dtype"]),
        "logits": chunks.chunk_logits.astype(np.float32),
        "windows_frames": frames,
        "windows_seconds": frames / result.fps,
        "fps": np.float64(result.fps),
        "frame_stride": np.int64(chunks.stride),
        "chunk": np.int64(settings["chunk"]),
        "overlap": np.int64(settings["overlap"]),
        "num_frames": np.int64(result.num_frames),
        "view_fusion": np.str_(settings["view_fusion"]),
        "temporal_head": np.str_(settings["temporal_head"]),
        "video": np.str_(json.dumps(record.views)),
        "class_names": np.array(class_names, dtype=np.str_),
        "checkpoint_sha256": np.str_(settings["checkpoint_sha256"]),
        "config": np.str_(dump(cfg)),
        "checkpoint": np.str_(os.path.abspath(checkpoint) if checkpoint else ""),
        "settings": np.str_(json.dumps(settings, sort_keys=True)),
    }
    with atomic_open(path) as f:
        np.savez(f, **arrays)


def mstcn_name(name: str) -> str:
    """A features file's name in MS-TCN's layout: its loaders take a video's name up to its first dot."""
    return os.path.splitext(name)[0].replace(".", "_")


def mstcn_features_path(directory: str, name: str) -> str:
    return os.path.join(directory, "features", f"{mstcn_name(name)}.npy")


def write_mstcn(directory: str, name: str, result: VideoResult, record: VideoRecord, class_names: list[str]) -> None:
    """``result``'s chunk features in MS-TCN's layout under ``directory``, one "frame" of it an inference chunk:
    features/NAME.npy [D, n] float32 and, where the record has segments, groundTruth/NAME.txt with each chunk's
    label (the segment covering most of its frames; ``background`` where none covers it)."""
    chunks, labels = result.features, None
    if record.segments is not None:
        _, per_chunk = video_labels(record, result.num_frames, result.fps, chunks.frame_windows, class_names)
        labels = [class_names[i] if i >= 0 else BACKGROUND for i in per_chunk]
    write_video(directory, mstcn_name(name), chunks.features, labels)


def write_mstcn_index(output: FeatureOutput, class_names: list[str], labelled: bool) -> list[str]:
    """splits/<bundle>.bundle with every video of the input list whose files are there (all shards' so far:
    the last shard to finish lists them all), and with ``labelled`` videos mapping.txt: the classes, then
    ``background`` if it is not one. Returns the bundle's names."""
    done = [
        mstcn_name(name)
        for name in output.all_names
        if os.path.exists(mstcn_features_path(output.directory, name))
        and (not labelled or os.path.exists(os.path.join(output.directory, "groundTruth", f"{mstcn_name(name)}.txt")))
    ]
    classes = [*class_names, BACKGROUND] if BACKGROUND not in class_names else class_names
    write_index(output.directory, classes if labelled else None, {output.bundle: done})
    return done


def video_labels(
    record: VideoRecord, num_frames: int, fps: float, windows: np.ndarray, class_names: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """(each frame's label [num_frames], each chunk's [n]: the label covering most of its frames), as class indices,
    -1 where none: from the record's segments, else its label for every frame."""
    segments = segment_frames(record, num_frames, fps, class_names) if record.segments is not None else None
    label = class_names.index(record.label) if record.label is not None else -1
    frames = frame_labels(segments, np.arange(num_frames), label)
    per_chunk = chunk_labels(torch.from_numpy(frames)[None], [tuple(w) for w in np.asarray(windows).tolist()])
    return frames, per_chunk[:, 0].numpy()


HEADER_KEYS = ("video", "settings", "checkpoint_sha256", "fps", "num_frames", "chunk", "overlap", "frame_stride")


def read_header(path: str) -> dict:
    """A features file's small entries (not its arrays): what training on it checks and matches; "checkpoint" is
    "" for files written before it was recorded; "chunks" and "feature_dim" the shape of its features."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            header = {key: saved[key].item() for key in HEADER_KEYS}
            header["checkpoint"] = saved["checkpoint"].item() if "checkpoint" in saved.files else ""
            header["chunks"], header["feature_dim"] = _stored_shape(saved.zip, "features")
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise UsageError(f"{path}: not a features file of this tool ({e}); write it with infer_chunked.py --features")
    header["views"] = json.loads(header.pop("video"))
    return header


def _stored_shape(archive: zipfile.ZipFile, name: str) -> tuple:
    """The shape of an array in an open .npz (its ``zip``) from the array's header alone (not its data: a whole
    video's features)."""
    with archive.open(f"{name}.npy") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return read(f)[0]


def read_arrays(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(features [n, D] float32, windows_frames [n, 2] int64) of a features file."""
    with np.load(path, allow_pickle=False) as saved:
        return saved["features"].astype(np.float32), saved["windows_frames"].astype(np.int64)
