"""The windowed video dataset: long videos split into sample windows, one clip decoded per sample.

The index is built from metadata only (frame counts from the containers, cached). A sample returns a
dict of uint8 frames (converted to float on the device, see ``datasets.device_input``), the keypoints of
the same frames, the label of the part of the timeline it covers, and where it came from.

A sample (``VideoWindowDataset[i]``), T = the clip's frames (``data.num_frames``, or the window's with -1):

    "label"          int                      the class of the window (of its mirror class after a flip)
    "sample"         int                      the sample's index in the dataset (train.feature_bank reads by it)
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

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from config import Config, DataConfig
from datasets.bad_input import BAD_INPUT_ERRORS, MAX_CONSECUTIVE_FAILURES
from datasets.clip_transform import ClipTransform
from datasets.decode import read_clip, read_clip_keypoints
from datasets.keypoints import keypoint_length
from datasets.manifest import ManifestError, VideoRecord, read_manifest
from datasets.prepared_copies import PreparedCopies
from datasets.records import (
    check_labels,
    frame_labels,
    read_split,
    segment_frames,
    training_records,
    unlabelled,
)
from datasets.sample import Sample
from datasets.video.index_cache import VideoIndexCache
from datasets.video.info import StalledFile, VideoReadError, several_streams_note
from datasets.video.prober import Prober
from datasets.video.reader_cache import ReaderCache
from datasets.windows import clip_indices, split_into_windows, video_stride
from datasets.workers import WORKER_NOTES, StallWatch

log = logging.getLogger("longvideo." + __name__)  # printed through the project logger


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


class VideoWindowDataset(Dataset):
    def __init__(
        self,
        records: list[VideoRecord],
        class_names: list[str],
        data_cfg: DataConfig,
        training: bool,
        seed: int = 0,
        index_cache: VideoIndexCache | None = None,
    ):
        self.records, self.class_names = records, list(class_names)
        self.class_index = {name: i for i, name in enumerate(self.class_names)}
        self.cfg, self.training, self.seed, self.epoch = data_cfg, training, seed, 0
        # train.feature_bank: each training clip placed as evaluation places it, the same frames every epoch
        self.fixed_clips = False
        self.transform = ClipTransform(data_cfg, training)  # decode size, crops, augmentation
        self.crops = self.transform.crops  # evaluation crops per sample window (data.test_crops), each a sample
        self.clips = 1 if training else data_cfg.test_clips  # evaluation clips per sample window, each crops
        self.samples_per_window = self.clips * self.crops  # test clips x crops: clip-major, crop-minor
        self.skipped: dict[str, str] = {}  # file -> error, for samples dropped at index time
        self.timed_out: dict[int, str] = {}  # sample -> report, of samples whose worker was stopped (skip)
        self.stall_folder: str | None = None  # where workers report a stalled sample (set by the loader)
        self.watch: StallWatch | None = None  # in a worker, with data.sample_timeout_s
        self.video_info: dict = {}  # path -> VideoInfo from the index: readers in the workers do not probe again
        self.fps: dict[str, float] = {}  # first view's path -> frame rate (segments given in seconds)
        self.copies = PreparedCopies(data_cfg)  # data.prepared_dir
        self.read_from: dict = {}  # path -> (the path, VideoInfo) its frames are read from: a prepared copy, or itself
        cache = index_cache or VideoIndexCache(None)
        prober = Prober(data_cfg.sample_timeout_s)  # a header that never comes stops in a child, not here
        try:
            self.lengths = [self._record_length(r, cache, prober) for r in records]
        finally:
            prober.close()
        cache.save()
        if self.copies.summary():
            log.info("%s", self.copies.summary())
        self.view_names = self._check_views()
        self.windows = [w for i, r in enumerate(records) if self.lengths[i] > 0 for w in self._windows_of(i, r)]
        if not self.windows:
            raise ManifestError(f"{records[0].where.rsplit(':', 1)[0]}: no usable samples")
        self.mirror = self._class_mirror()  # class index -> the class a flip turns it into (flip_label_pairs)
        self._check_joint_pairs()
        window = data_cfg.max_video_frames
        if window is not None:
            usable = sum(1 for n in self.lengths if n > 0)
            log.info("sample windows: %d videos -> %d windows of at most %d frames", usable, len(self.windows), window)

    # ------------------------------------------------------------------------------------------ the index
    def _record_length(self, record: VideoRecord, cache: VideoIndexCache, prober=None) -> int:
        """Frames usable in every view (the shortest view; a shorter view is reported); 0 = skipped."""
        try:
            check_labels(record, self.class_names)
            if not self.cfg.load_rgb:
                if record.keypoints is None:
                    raise ManifestError(f"{record.where}: no 'keypoints' given, and data.load_rgb is false")
                return keypoint_length(record.keypoints)
            infos = {name: cache.info(path, self.cfg.decoder, prober) for name, path in record.views.items()}
            self.video_info.update({path: infos[name] for name, path in record.views.items()})
            for info in infos.values():
                for note in filter(None, (several_streams_note(info), info.header_note())):
                    log.warning("%s", note)
            for name, path in record.views.items():
                self.read_from[path] = self.copies.read_from(path, infos[name])
            # a copy holds the frames its source decodes: of a file cut short, fewer than its packets
            lengths = {name: self.read_from[path][1].num_frames for name, path in record.views.items()}
            if len(set(lengths.values())) > 1:
                log.warning("%s: views have different lengths %s; using the shortest", record.where, lengths)
            self.fps[record.first_path] = next(iter(infos.values())).fps
            return min(lengths.values())
        except BAD_INPUT_ERRORS as e:
            if self.cfg.on_bad_video == "raise":
                raise type(e)(f"{e} (sample at {record.where})") from None
            log.warning("skipping %s: %s", record.where, e)
            self.skipped[record.first_path] = f"{e} (sample at {record.where})"
            return 0

    def _class_mirror(self) -> np.ndarray:
        """data.flip_label_pairs as an index array: each class, or the one a flip swaps it with."""
        mirror = np.arange(len(self.class_names))
        for pair in self.cfg.flip_label_pairs or []:
            unknown = [str(name) for name in pair if str(name) not in self.class_index]
            if unknown:
                raise ManifestError(
                    f"data.flip_label_pairs names {', '.join(unknown)}, not a class of the data "
                    f"({', '.join(self.class_names)})"
                )
            a, b = (self.class_index[str(name)] for name in pair)
            mirror[a], mirror[b] = b, a
        return mirror

    def _check_joint_pairs(self) -> None:
        """The joints data.kpt_flip_pairs names exist in this data's keypoints."""
        joints = max((j for pair in self.cfg.kpt_flip_pairs or [] for j in pair), default=-1)
        shape = self.keypoint_shape() if joints >= 0 else None
        if shape is not None and joints >= shape[0]:
            raise ManifestError(
                f"data.kpt_flip_pairs names joint {joints}, but the keypoints have {shape[0]} "
                f"joints (0 to {shape[0] - 1})"
            )

    def _check_views(self) -> list[str]:
        names = {tuple(r.views) for r, n in zip(self.records, self.lengths) if n > 0}
        if len(names) > 1:
            raise ManifestError(
                f"{self.records[0].where.rsplit(':', 1)[0]}: samples have different camera "
                f"views {sorted(names)}; every sample needs the same views"
            )
        return list(next(iter(names), ("video",)))

    def _windows_of(self, record_index: int, record: VideoRecord) -> list[SampleWindow]:
        length = self.lengths[record_index]
        timeline = None
        if record.segments is not None:
            timeline = segment_frames(record, length, self.fps.get(record.first_path, 25.0), self.class_names)
        windows = []
        for start, end in split_into_windows(length, self.cfg.max_video_frames, self.cfg.sample_window_overlap):
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

    def balance_weights(self, balance: str) -> torch.Tensor:
        """Each sample's weight in a training epoch's draw (data.balance): videos, each video's samples share one
        weight; classes, each class's videos share one, and each video's samples its share."""
        video_of = [self.windows[i // self.samples_per_window].record for i in range(len(self))]
        per_video = Counter(video_of)
        weights = torch.tensor([1.0 / per_video[v] for v in video_of], dtype=torch.float64)
        if balance == "classes":
            if any(self.records[v].label is None for v in per_video):
                raise ManifestError(
                    "data.balance: classes weighs each video by its label; a timeline (segments) has none: use "
                    "data.balance: videos"
                )
            class_of = {v: self.records[v].label for v in per_video}
            videos_in = Counter(class_of.values())
            weights *= torch.tensor([1.0 / (len(videos_in) * videos_in[class_of[v]]) for v in video_of])
        return weights

    # ---------------------------------------------------------------------------------------- the samples
    def set_epoch(self, epoch: int) -> None:
        """Clip placement depends on (seed, epoch, sample), not on which worker loads it: runs repeat."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.windows) * self.samples_per_window

    def __getitem__(self, index: int) -> Sample:
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
                record = self.records[self.windows[candidate // self.samples_per_window].record]
                if self.cfg.on_bad_video == "raise":
                    raise type(e)(f"{e} (sample at {record.where})") from None
                skipped[record.first_path] = f"{e} (sample at {record.where})"
            finally:
                if self.watch is not None:
                    self.watch.loading = None
        else:
            raise VideoReadError(
                f"{len(skipped)} consecutive samples failed to load (data.on_bad_video: skip), the "
                f"last: {list(skipped.values())[-1]}; check the data"
            )
        # reported by the main process (BadInputReport): once per run, whichever worker met it
        sample["skipped"], sample["notes"] = skipped, list(WORKER_NOTES)
        WORKER_NOTES.clear()
        return sample

    # ---------------------------------------------------------------------------------------- the deadline
    def start_watch(self, worker_id: int) -> None:
        """In a DataLoader worker: the watchdog of data.sample_timeout_s (``StallWatch``), if one is set."""
        if self.cfg.sample_timeout_s is not None and self.stall_folder is not None:
            self.watch = StallWatch(self.cfg.sample_timeout_s, self.stall_folder, worker_id, self.describe)

    def describe(self, index: int) -> str:
        window = self.windows[index // self.samples_per_window]
        record = self.records[window.record]
        return f"{record.first_path}: sample window [{window.start}, {window.end}) ({record.where})"

    def path_of(self, index: int) -> str:
        return self.records[self.windows[index // self.samples_per_window].record].first_path

    def _load(self, index: int) -> Sample:
        window = self.windows[index // self.samples_per_window]
        record = self.records[window.record]
        clip = (index % self.samples_per_window) // self.crops  # which of data.test_clips (evaluation)

        def place_clip(end: int) -> np.ndarray:
            random = self.training and not self.fixed_clips
            rng = np.random.default_rng([self.seed, self.epoch, index]) if random else None
            stride = video_stride(self.cfg.frame_stride, self.cfg.fps, self.fps.get(record.first_path))
            return clip_indices(window.start, end, self.cfg.num_frames, stride, rng, clip, self.clips)

        # augmentation draws its own stream: the clip's placement stays what it was without augmentation
        rng = np.random.default_rng([self.seed, self.epoch, index, 1]) if self.training else None
        plans = self.transform.plan(self._sources(record), rng, index % self.crops) if self.cfg.load_rgb else []
        colour = self.transform.colour_factors(rng)  # drawn after the geometry, as ever: samples stay the same
        indices, views = place_clip(window.end), []
        if plans:
            indices, views = self._read_frames(record, window, place_clip, plans, colour)
        label, labels = window.label, frame_labels(window.segments, indices, window.label)
        if plans and plans[0].flipped:  # a mirrored clip of a class with a side is one of its mirror class
            label, labels = int(self.mirror[label]), np.where(labels >= 0, self.mirror[labels], -1)
        sample: Sample = {
            "label": label,
            "sample": index,
            "video_index": window.record,
            "window": torch.tensor([window.start, window.end]),
            "frame_indices": torch.from_numpy(indices),
            "frame_labels": torch.from_numpy(labels),
        }
        if views:
            sample["video"] = views[0] if len(views) == 1 else torch.stack(views)
        if self.cfg.load_kpt:
            sample["kpt"] = torch.from_numpy(read_clip_keypoints(record, indices, plans, self.transform))
        return sample

    def _sources(self, record: VideoRecord) -> list[tuple[int, int]]:
        """Each view's (height, width) as read: as displayed."""
        return [self.video_info[path].frame_size() for path in record.views.values()]

    def _read_frames(
        self, record: VideoRecord, window: SampleWindow, place_clip, plans: list, colour: tuple | None
    ) -> tuple[np.ndarray, list]:
        """(frame indices, each view's uint8 [C, T, H, W] clip: ``datasets.decode.read_clip``)."""
        opened = [(*self.read_from[path], plan.decoded) for path, plan in zip(record.views.values(), plans)]
        readers = [_READERS.get(path, size, info, self.cfg.decoder) for path, info, size in opened]
        end = min([window.end] + [r.num_frames for r in readers])
        while True:  # at most twice: a read can find the video shorter than its container says
            if end <= window.start:
                raise VideoReadError(
                    f"{record.first_path}: the video ends at frame {end}, before this "
                    f"sample window [{window.start}, {window.end})"
                )
            indices = place_clip(end)
            views = read_clip(readers, indices, plans, self.transform, colour)
            real_end = min(r.num_frames for r in readers)
            if real_end >= end:
                return indices, views
            end = real_end  # shrink the window to the frames that exist

    # ------------------------------------------------------------------------------------------- helpers
    def keypoint_shape(self) -> tuple[int, int] | None:
        if not self.cfg.load_kpt:
            return None
        window = self.windows[0]
        kpt = read_clip_keypoints(self.records[window.record], [window.start], [], self.transform)  # no decoding
        return int(kpt.shape[1]), int(kpt.shape[2])


def index_cache_for(cfg: Config) -> VideoIndexCache:
    path = os.path.join(cfg.trainer.output_dir, ".video_index.json")
    return VideoIndexCache(path)


def build_dataset(
    cfg: Config,
    split: str,
    class_names: list[str],
    training: bool,
    manifest: str | None = None,
    index_cache: VideoIndexCache | None = None,
    records: list[VideoRecord] | None = None,
) -> VideoWindowDataset:
    labelled = cfg.train.reads_labels
    if records is None and manifest:
        records = read_manifest(manifest, labelled)
    elif records is None and split == "val" and cfg.data.val_fraction:  # the videos training split off
        records = training_records(cfg.data, labelled)[1]
    elif records is None:
        records = read_split(cfg.data, split, labelled)
    if not labelled:
        records = unlabelled(records, class_names[0])
    return VideoWindowDataset(
        records, class_names, cfg.data, training=training, seed=cfg.train.seed, index_cache=index_cache
    )
