"""The windowed video dataset: long videos split into sample windows, one clip decoded per sample.

The index is built from metadata only (frame counts from the containers, cached). A sample returns a
dict of uint8 frames (converted to float on the device, see ``datasets.transforms``), the keypoints of
the same frames, the label of the part of the timeline it covers, and where it came from.

A sample (``VideoWindowDataset[i]``), T = the clip's frames (``data.num_frames``, or the window's with -1):

    "label"          int                      the class of the window (of its mirror class after a flip)
    "video_index"    int                      which manifest line (video-level metrics sum its clips)
    "window"         int64 [2]                the sample window [start, end) in video frames
    "frame_indices"  int64 [T]                the video frames decoded
    "frame_labels"   int64 [T]                each frame's class from the timeline's segments, -1 where none
    "video"          uint8 [C, T, H, W]       with data.load_rgb; [V, C, T, H, W] with V camera views
    "kpt"            float32 [T, J, C]        with data.load_kpt (x, y first; NaN: missing joint)
    "skipped", "notes"                        files skipped (on_bad_video: skip) and warnings, for the main process

``collate_samples`` stacks them into a batch with a leading B axis.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from core.files import atomic_write_bytes
from datasets.clip_transform import ClipTransform
from datasets.decode import read_clip, read_clip_keypoints
from datasets.keypoints import KeypointError, keypoint_length
from datasets.manifest import ManifestError, VideoRecord, read_manifest
from datasets.video.index_cache import VideoIndexCache
from datasets.video.info import StalledFile, VideoReadError, several_streams_note
from datasets.video.prober import Prober
from datasets.video.reader_cache import ReaderCache
from datasets.windows import clip_indices, split_into_windows

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger

BAD_INPUT_ERRORS = (VideoReadError, KeypointError, ManifestError)
MAX_CONSECUTIVE_FAILURES = 50  # samples skipped in a row (on_bad_video: skip) before the data is called broken
_WORKER_NOTES: list[str] = []  # warnings met in a DataLoader worker, handed to the main process with a sample


class _NotesHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _WORKER_NOTES.append(record.getMessage())


def worker_init(worker_id: int) -> None:
    """A worker's warnings (a file shorter than its container says, ...) go to the main process with the next
    sample instead of the console: printed once per run there, not once per worker and epoch. With
    data.sample_timeout_s, a watchdog thread ends the worker whose sample passes the deadline (``StallWatch``)."""
    logging.getLogger("longvideo").handlers = [_NotesHandler()]
    info = torch.utils.data.get_worker_info()
    if info is not None and isinstance(info.dataset, VideoWindowDataset):
        info.dataset.start_watch(worker_id)


class StallWatch:
    """The deadline of a sample in a DataLoader worker.

    A sample blocked inside FFmpeg (a file on a stalled network mount, a decoder that never returns) cannot be
    interrupted from Python: no exception reaches a thread waiting in C, and a signal only runs its handler once
    the C call returns. What can always be stopped is the process. So each worker runs this watchdog thread; when
    the sample being loaded passes ``timeout`` seconds it writes a report (file, window, worker) into ``folder``
    and ends the worker (``os._exit``). The main process sees the worker gone, reads the report
    (``take_stall_report``) and acts as data.on_bad_video says (engine.data.GuardedBatches). A watchdog in the
    worker, not one decode process per sample: the usual path costs one thread and a timestamp per sample.
    """

    def __init__(self, timeout: float, folder: str, worker_id: int, describe):
        self.timeout, self.folder, self.worker_id, self.describe = timeout, folder, worker_id, describe
        self.loading: tuple[float, int] | None = None  # (start, sample index) of the sample being loaded
        threading.Thread(target=self._watch, daemon=True, name="sample-deadline").start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            loading = self.loading
            if loading is not None and time.monotonic() - loading[0] > self.timeout:
                report = {"index": loading[1], "message": f"{self.describe(loading[1])} still loading after "
                          f"{self.timeout:g} s (data.sample_timeout_s) in DataLoader worker {self.worker_id} "
                          f"(pid {os.getpid()}): a stalled mount or a decoder that does not return"}
                atomic_write_bytes(os.path.join(self.folder, f"{os.getpid()}.json"), json.dumps(report).encode())
                os._exit(3)  # the only way out of a call blocked in C; the main process takes it from here


def take_stall_report(dataset) -> dict | None:
    """The report of a worker that ended itself on a stalled sample ({"index", "message"}), removed once read."""
    folder = getattr(dataset, "stall_folder", None)
    for name in sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if name.endswith(".json"):
            with open(path) as f:
                report = json.load(f)
            os.unlink(path)
            return report
    return None


class BadInputReport:
    """In the main process: the warnings the samples carry, printed once per run; the files skipped
    (data.on_bad_video: skip) with their reasons, listed at the end of each epoch and of the run, those rejected
    while indexing included."""

    def __init__(self, *datasets):
        self.indexed = {path: reason for d in datasets if d is not None for path, reason in d.skipped.items()}
        self.skipped: dict[str, str] = dict(self.indexed)  # the run's
        self.epoch: dict[str, str] = {}
        self.seen: set[str] = set()

    def take(self, batch: dict) -> None:
        for note in batch.pop("notes", []):
            if note not in self.seen:
                self.seen.add(note)
                log.warning("%s", note)
        for path, reason in batch.pop("skipped", {}).items():
            if path not in self.skipped:
                log.warning("skipping %s", reason)
            self.skipped.setdefault(path, reason)
            self.epoch.setdefault(path, reason)

    def end_epoch(self, epoch: int) -> None:
        listed = {**self.indexed, **self.epoch}
        if listed:
            log.warning("epoch %d: %d file(s) skipped: %s", epoch, len(listed), self._text(listed))
        self.epoch = {}

    def end_run(self) -> None:
        if self.skipped:
            log.warning("run: %d file(s) skipped (data.on_bad_video: skip): %s", len(self.skipped),
                        self._text(self.skipped))

    @staticmethod
    def _text(files: dict) -> str:
        return "; ".join(f"{path} ({reason})" for path, reason in sorted(files.items()))


def collate_samples(samples: list[dict]) -> dict:
    """default_collate for the tensors; the samples' reports (``skipped``: file -> reason, ``notes``: warnings)
    merged as they are, for BadInputReport (default_collate would transpose them, or fail on unequal lengths)."""
    reports = [(s.pop("skipped", {}), s.pop("notes", [])) for s in samples]
    batch = default_collate(samples)
    batch["skipped"] = {path: reason for skipped, _ in reports for path, reason in skipped.items()}
    batch["notes"] = [note for _, notes in reports for note in notes]
    return batch


_READERS = ReaderCache(capacity=4, threads=1)  # per process: each DataLoader worker has its own


@dataclass
class SampleWindow:
    record: int  # index into the dataset's records (= "video_index")
    start: int
    end: int
    label: int  # the label covering most frames of the window
    segments: list  # [(start, end, class index)] of the timeline, clipped to the window


def before_workers_fork(num_workers: int) -> None:
    """Workers x decoder threads must not oversubscribe the cores: one OpenCV thread per worker. Set in the
    parent before the workers fork: cv2.setNumThreads in a forked worker deadlocked once the parent had used
    OpenCV's thread pool (one cvtColor of a 720p frame was enough), since the pool's threads are not copied by
    fork but its locks are."""
    if num_workers > 0:
        cv2.setNumThreads(1)


class VideoWindowDataset(Dataset):
    def __init__(self, records: list[VideoRecord], class_names: list[str], data_cfg: dict, training: bool,
                 seed: int = 0, index_cache: VideoIndexCache | None = None):
        self.records, self.class_names = records, list(class_names)
        self.class_index = {name: i for i, name in enumerate(self.class_names)}
        self.cfg, self.training, self.seed, self.epoch = data_cfg, training, seed, 0
        self.transform = ClipTransform(data_cfg, training)  # decode size, crops, augmentation
        self.crops = self.transform.crops  # evaluation crops per sample window (data.test_crops), each a sample
        self.clips = 1 if training else data_cfg["test_clips"]  # evaluation clips per sample window, each crops
        self.views = self.clips * self.crops  # samples per sample window: clip-major, crop-minor
        self.skipped: dict[str, str] = {}  # file -> error, for samples dropped at index time
        self.timed_out: dict[int, str] = {}  # sample -> report, of samples whose worker was stopped (skip)
        self.stall_folder: str | None = None  # where workers report a stalled sample (set by the loader)
        self.watch: StallWatch | None = None  # in a worker, with data.sample_timeout_s
        self.video_info: dict = {}  # path -> VideoInfo from the index: readers in the workers do not probe again
        self.fps: dict[str, float] = {}  # first view's path -> frame rate (segments given in seconds)
        cache = index_cache or VideoIndexCache(None)
        prober = Prober(data_cfg["sample_timeout_s"])  # a header that never comes stops in a child, not here
        try:
            self.lengths = [self._record_length(r, cache, prober) for r in records]
        finally:
            prober.close()
        cache.save()
        self.view_names = self._check_views()
        self.windows = [w for i, r in enumerate(records) if self.lengths[i] > 0 for w in self._windows_of(i, r)]
        if not self.windows:
            raise ManifestError(f"{records[0].where.rsplit(':', 1)[0]}: no usable samples")
        self.mirror = self._class_mirror()  # class index -> the class a flip turns it into (flip_label_pairs)
        self._check_joint_pairs()
        window = data_cfg["max_video_frames"]
        if window is not None:
            usable = sum(1 for n in self.lengths if n > 0)
            log.info("Video chunking enabled: %d videos -> %d chunks (max %d frames/chunk)", usable,
                     len(self.windows), window)

    # ------------------------------------------------------------------------------------------ the index
    def _record_length(self, record: VideoRecord, cache: VideoIndexCache, prober=None) -> int:
        """Frames usable in every view (the shortest view; a shorter view is reported); 0 = skipped."""
        try:
            check_labels(record, self.class_names)
            if not self.cfg["load_rgb"]:
                if record.keypoints is None:
                    raise ManifestError(f"{record.where}: no 'keypoints' given, and data.load_rgb is false")
                return keypoint_length(record.keypoints)
            infos = {name: cache.info(path, self.cfg["decoder"], prober) for name, path in record.views.items()}
            self.video_info.update({path: infos[name] for name, path in record.views.items()})
            for info in infos.values():
                for note in filter(None, (several_streams_note(info), info.header_note())):
                    log.warning("%s", note)
            lengths = {name: info.num_frames for name, info in infos.items()}
            if len(set(lengths.values())) > 1:
                log.warning("%s: views have different lengths %s; using the shortest", record.where, lengths)
            self.fps[record.first_path] = next(iter(infos.values())).fps
            return min(lengths.values())
        except BAD_INPUT_ERRORS as e:
            if self.cfg["on_bad_video"] == "raise":
                raise type(e)(f"{e} (sample at {record.where})") from None
            log.warning("skipping %s: %s", record.where, e)
            self.skipped[record.first_path] = f"{e} (sample at {record.where})"
            return 0

    def _class_mirror(self) -> np.ndarray:
        """data.flip_label_pairs as an index array: each class, or the one a flip swaps it with."""
        mirror = np.arange(len(self.class_names))
        for pair in self.cfg["flip_label_pairs"] or []:
            unknown = [str(name) for name in pair if str(name) not in self.class_index]
            if unknown:
                raise ManifestError(f"data.flip_label_pairs names {', '.join(unknown)}, not a class of the data "
                                    f"({', '.join(self.class_names)})")
            a, b = (self.class_index[str(name)] for name in pair)
            mirror[a], mirror[b] = b, a
        return mirror

    def _check_joint_pairs(self) -> None:
        """The joints data.kpt_flip_pairs names exist in this data's keypoints."""
        joints = max((j for pair in self.cfg["kpt_flip_pairs"] or [] for j in pair), default=-1)
        shape = self.keypoint_shape() if joints >= 0 else None
        if shape is not None and joints >= shape[0]:
            raise ManifestError(f"data.kpt_flip_pairs names joint {joints}, but the keypoints have {shape[0]} "
                                f"joints (0 to {shape[0] - 1})")

    def _check_views(self) -> list[str]:
        names = {tuple(r.views) for r, n in zip(self.records, self.lengths) if n > 0}
        if len(names) > 1:
            raise ManifestError(f"{self.records[0].where.rsplit(':', 1)[0]}: samples have different camera "
                                f"views {sorted(names)}; every sample needs the same views")
        return list(next(iter(names), ("video",)))

    def _windows_of(self, record_index: int, record: VideoRecord) -> list[SampleWindow]:
        length = self.lengths[record_index]
        timeline = None
        if record.segments is not None:
            timeline = segment_frames(record, length, self.fps.get(record.first_path, 25.0), self.class_names)
        windows = []
        for start, end in split_into_windows(length, self.cfg["max_video_frames"], self.cfg["video_chunk_overlap"]):
            if timeline is None:
                windows.append(SampleWindow(record_index, start, end, self.class_index[record.label], []))
                continue
            clipped = [(max(s, start), min(e, end), c) for s, e, c in timeline if s < end and e > start]
            if not clipped:  # a gap in the timeline: no label for this window
                continue
            cover = Counter()
            for s, e, c in clipped:
                cover[c] += e - s
            label = max(cover, key=lambda c: (cover[c], -min(s for s, _, k in clipped if k == c)))
            windows.append(SampleWindow(record_index, start, end, label, clipped))
        return windows

    # ---------------------------------------------------------------------------------------- the samples
    def set_epoch(self, epoch: int) -> None:
        """Clip placement depends on (seed, epoch, sample), not on which worker loads it: runs repeat."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.windows) * self.views

    def __getitem__(self, index: int) -> dict:
        skipped: dict[str, str] = {}
        for attempt in range(min(len(self), MAX_CONSECUTIVE_FAILURES)):
            candidate = (index + attempt) % len(self)
            try:
                if candidate in self.timed_out:  # its worker was stopped on it before (on_bad_video: skip)
                    raise StalledFile(self.timed_out[candidate])
                if self.watch is not None:
                    self.watch.loading = (time.monotonic(), candidate)
                sample = self._load(candidate)
                break
            except BAD_INPUT_ERRORS as e:
                record = self.records[self.windows[candidate // self.views].record]
                if self.cfg["on_bad_video"] == "raise":
                    raise type(e)(f"{e} (sample at {record.where})") from None
                skipped[record.first_path] = f"{e} (sample at {record.where})"
            finally:
                if self.watch is not None:
                    self.watch.loading = None
        else:
            raise VideoReadError(f"{len(skipped)} consecutive samples failed to load (data.on_bad_video: skip), the "
                                 f"last: {list(skipped.values())[-1]}; check the data")
        # reported by the main process (BadInputReport): once per run, whichever worker met it
        sample["skipped"], sample["notes"] = skipped, list(_WORKER_NOTES)
        _WORKER_NOTES.clear()
        return sample

    # ---------------------------------------------------------------------------------------- the deadline
    def start_watch(self, worker_id: int) -> None:
        """In a DataLoader worker: the watchdog of data.sample_timeout_s (``StallWatch``), if one is set."""
        if self.cfg["sample_timeout_s"] is not None and self.stall_folder is not None:
            self.watch = StallWatch(self.cfg["sample_timeout_s"], self.stall_folder, worker_id, self.describe)

    def describe(self, index: int) -> str:
        window = self.windows[index // self.views]
        record = self.records[window.record]
        return f"{record.first_path}: sample window [{window.start}, {window.end}) ({record.where})"

    def path_of(self, index: int) -> str:
        return self.records[self.windows[index // self.views].record].first_path

    def _load(self, index: int) -> dict:
        window = self.windows[index // self.views]
        record = self.records[window.record]
        clip = (index % self.views) // self.crops  # which of data.test_clips (evaluation)

        def place_clip(end: int) -> np.ndarray:
            rng = np.random.default_rng([self.seed, self.epoch, index]) if self.training else None
            return clip_indices(window.start, end, self.cfg["num_frames"], self.cfg["frame_stride"], rng, clip,
                                self.clips)

        # augmentation draws its own stream: the clip's placement stays what it was without augmentation
        rng = np.random.default_rng([self.seed, self.epoch, index, 1]) if self.training else None
        plans = self.transform.plan(self._sources(record), rng, index % self.crops) if self.cfg["load_rgb"] else []
        colour = self.transform.colour_factors(rng)  # drawn after the geometry, as ever: samples stay the same
        indices, views = place_clip(window.end), []
        if plans:
            indices, views = self._read_frames(record, window, place_clip, plans, colour)
        label, frame_labels = window.label, self._frame_labels(window, indices)
        if plans and plans[0].flipped:  # a mirrored clip of a class with a side is one of its mirror class
            label, frame_labels = int(self.mirror[label]), np.where(frame_labels >= 0, self.mirror[frame_labels], -1)
        sample = {
            "label": label,
            "video_index": window.record,
            "window": torch.tensor([window.start, window.end]),
            "frame_indices": torch.from_numpy(indices),
            "frame_labels": torch.from_numpy(frame_labels),
        }
        if views:
            sample["video"] = views[0] if len(views) == 1 else torch.stack(views)
        if self.cfg["load_kpt"]:
            sample["kpt"] = torch.from_numpy(read_clip_keypoints(record, indices, plans, self.transform))
        return sample

    def _sources(self, record: VideoRecord) -> list[tuple[int, int]]:
        """Each view's (height, width) as read: displayed, or stored with data.autorotate false."""
        return [self.video_info[path].frame_size(self.cfg["autorotate"]) for path in record.views.values()]

    def _read_frames(self, record: VideoRecord, window: SampleWindow, place_clip, plans: list,
                     colour: tuple | None) -> tuple[np.ndarray, list]:
        """(frame indices, each view's uint8 [C, T, H, W] clip: ``datasets.decode.read_clip``)."""
        readers = [_READERS.get(path, plan.decoded, self.video_info.get(path), self.cfg["decoder"],
                                self.cfg["autorotate"])
                   for path, plan in zip(record.views.values(), plans)]
        end = min([window.end] + [r.num_frames for r in readers])
        while True:  # at most twice: a read can find the video shorter than its container says
            if end <= window.start:
                raise VideoReadError(f"{record.first_path}: the video ends at frame {end}, before this "
                                     f"sample window [{window.start}, {window.end})")
            indices = place_clip(end)
            views = read_clip(readers, indices, plans, self.transform, colour)
            real_end = min(r.num_frames for r in readers)
            if real_end >= end:
                return indices, views
            end = real_end  # shrink the window to the frames that exist

    @staticmethod
    def _frame_labels(window: SampleWindow, indices: np.ndarray) -> np.ndarray:
        if not window.segments:
            return np.full(len(indices), window.label, dtype=np.int64)
        labels = np.full(len(indices), -1, dtype=np.int64)  # -1: a frame no segment covers
        for s, e, c in window.segments:
            labels[(indices >= s) & (indices < e)] = c
        return labels

    # ------------------------------------------------------------------------------------------- helpers
    def keypoint_shape(self) -> tuple[int, int] | None:
        if not self.cfg["load_kpt"]:
            return None
        window = self.windows[0]
        kpt = read_clip_keypoints(self.records[window.record], [window.start], [], self.transform)  # no decoding
        return int(kpt.shape[1]), int(kpt.shape[2])


def check_labels(record: VideoRecord, class_names: list[str], unlabelled_ok: bool = False) -> None:
    """Every label of a manifest line (its label, its segments') is a known class; shared by training,
    evaluation and infer_chunked.py (where a line may have no label: ``unlabelled_ok``), so they refuse the
    same lines with the same message."""
    for label in record.labels():
        if label is None and unlabelled_ok:
            continue
        if label not in class_names:
            raise ManifestError(f"{record.where}: label '{label}' is not a known class ({', '.join(class_names)})")


def segment_frames(record: VideoRecord, length: int, fps: float, class_names: list[str]) -> list[tuple]:
    """A line's segments as (start, end, class index) frames, cut at the video's ``length``; a segment that
    starts after the video's end is an error."""
    timeline = []
    for seg in record.segments:
        start, end = seg.in_frames(fps)
        if start >= length:
            raise ManifestError(f"{record.where}: segment [{start}, {end}) '{seg.label}' starts after "
                                f"the video's {length} frames")
        timeline.append((start, min(end, length), class_names.index(seg.label)))
    return timeline


def manifest_path(data_cfg: dict, split: str) -> str | None:
    name = data_cfg[f"{split}_manifest"]
    if name is None:
        return None
    return name if os.path.isabs(name) else os.path.join(data_cfg["data_dir"], name)


def resolve_class_names(data_cfg: dict, train_records) -> list[str]:
    if data_cfg["class_names"] is not None:
        return [str(n) for n in data_cfg["class_names"]]
    return sorted({label for r in train_records for label in r.labels()})


def index_cache_for(cfg: dict) -> VideoIndexCache:
    path = cfg["data"]["index_cache"] or os.path.join(cfg["trainer"]["output_dir"], ".video_index.json")
    return VideoIndexCache(path)


DATA_LAYOUTS = ('a JSONL manifest ({"video": "videos/a.mp4", "label": "left"} a line), a CSV with video,label '
                'columns, or a folder root/<class>/<video>')


def read_split(data_cfg: dict, split: str) -> list[VideoRecord]:
    """The manifest of ``data.<split>_manifest``; a missing one names the key and the accepted forms."""
    path = manifest_path(data_cfg, split)
    if path is None:
        raise ManifestError(f"data.{split}_manifest is null; set it to {DATA_LAYOUTS}")
    if not os.path.exists(path):
        raise ManifestError(f"{path}: not found (data.{split}_manifest, resolved against data.data_dir="
                            f"{data_cfg['data_dir']}); give {DATA_LAYOUTS}")
    return read_manifest(path)


def training_records(data_cfg: dict) -> tuple[list[VideoRecord], list[VideoRecord] | None]:
    """(training, validation) records: the two manifests, or one split by ``data.val_fraction``."""
    records = read_split(data_cfg, "train")
    fraction = data_cfg["val_fraction"]
    if fraction:
        chosen = [_in_validation(r, data_cfg["data_dir"], fraction) for r in records]
        train = [r for r, v in zip(records, chosen) if not v]
        val = [r for r, v in zip(records, chosen) if v]
        if not train or not val:
            raise ManifestError(f"data.val_fraction={fraction:g} leaves {len(train)} training and {len(val)} "
                                f"validation videos of {len(records)}; choose a fraction that leaves both")
        log.info("data.val_fraction=%g: %d videos for training, %d for validation (split by path, the same every "
                 "run)", fraction, len(train), len(val))
        return train, val
    if data_cfg["val_manifest"] is None:
        return records, None
    train_path, val_path = manifest_path(data_cfg, "train"), manifest_path(data_cfg, "val")
    if os.path.realpath(train_path) == os.path.realpath(val_path):
        log.warning("data.val_manifest and data.train_manifest are the same data (%s): validation measures the "
                    "training set; set data.val_fraction: 0.1 (a split by video) or give a separate manifest",
                    train_path)
    return records, read_split(data_cfg, "val")


def _in_validation(record: VideoRecord, data_dir: str, fraction: float) -> bool:
    """Whether a video goes to validation: a hash of its path relative to data.data_dir, so the split is the
    same on every run and machine, and a video's windows never land on both sides."""
    relative = os.path.relpath(record.first_path, data_dir)
    return int(hashlib.sha1(relative.encode()).hexdigest()[:8], 16) / 2 ** 32 < fraction


def build_dataset(cfg: dict, split: str, class_names: list[str], training: bool, manifest: str | None = None,
                  index_cache: VideoIndexCache | None = None,
                  records: list[VideoRecord] | None = None) -> VideoWindowDataset:
    if records is None:
        records = read_manifest(manifest) if manifest else read_split(cfg["data"], split)
    return VideoWindowDataset(records, class_names, cfg["data"], training=training, seed=cfg["train"]["seed"],
                              index_cache=index_cache)
