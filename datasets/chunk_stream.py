"""Streaming inference's frames: a video's inference chunks decoded on a background thread, a few chunks ahead of
the model (``ChunkStream``), with the dataset's path from file to frames (``datasets.decode``)."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Protocol

import numpy as np
import torch

from config import DataConfig
from datasets.clip_transform import ClipTransform
from datasets.decode import read_clip, read_clip_keypoints
from datasets.keypoints import KeypointError
from datasets.manifest import VideoRecord
from datasets.prepared_copies import PreparedCopies
from datasets.video.choice import open_reader
from datasets.video.info import StalledFile, VideoReadError, several_streams_note
from datasets.video.probe import probe
from datasets.windows import inference_windows, video_stride

log = logging.getLogger("longvideo")
_SAID_MISSING: set = set()  # sources whose missing prepared copy was said


class ChunkSettings(Protocol):
    """The inference chunks to decode (engine.inference.stream.InferenceSpec holds them)."""

    chunk: int  # clip frames per chunk; -1 = the whole video
    overlap: int
    aggregation: str  # last: only the last chunk
    batch: int  # chunks per group
    decode_threads: int | None


class ChunkStream:
    """Decodes a video's inference chunks on a background thread, a few chunks ahead of the model.

    Yields (windows, {"video": uint8 [n, (V,) C, L, H, W], "kpt": [n, L, J, C]}) for groups of ``batch``
    chunks. Window bounds are in clip frames; clip frame i is video frame ``first + i * stride``: the whole video
    (``first`` 0), or the sample window ``window`` [start, end) of video frames (evaluation of whole sample
    windows, ``crop`` of data.test_crops; without one, the centre).

    Every file access (the probe, the open, each group's decoding) happens on the thread, and the consumer waits
    for each at most data.sample_timeout_s: a file on a stalled mount is a StalledFile naming the file and the
    chunks, not a hang; the blocked thread is left behind (a daemon: it cannot be interrupted inside FFmpeg).
    """

    def __init__(
        self,
        record: VideoRecord,
        data_cfg: DataConfig,
        spec: ChunkSettings,
        prefetch: int = 2,
        window: tuple[int, int] | None = None,
        crop: int | None = None,
    ):
        """data_cfg: the frame size, stride, decoder and what to load (RGB, keypoints) of the config."""
        self.record, self.stride, self.timeout = record, data_cfg.frame_stride, data_cfg.sample_timeout_s
        self.first, self.last = window if window is not None else (0, None)
        self.crop = crop
        self.readers: dict = {}
        self.waiting_for = "its header"  # what the thread is reading, for the stall's message
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.decode_seconds = 0.0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(data_cfg, spec), daemon=True)
        self.thread.start()
        ready = self._get()
        if isinstance(ready, BaseException):
            self.close()
            raise ready

    def _run(self, data_cfg: DataConfig, spec: ChunkSettings) -> None:
        try:
            self._open(data_cfg, spec)
        except BaseException as e:  # hand the error to the consumer
            self._put(e)
            return
        self._put("ready")
        self._produce()

    def _open(self, data_cfg: DataConfig, spec: ChunkSettings) -> None:
        record = self.record
        # evaluation's geometry: aspect-true decode size and the centre crop, or crop ``crop`` of data.test_crops
        crops = 1 if self.crop is None else data_cfg.test_crops
        self.transform = ClipTransform(dataclasses.replace(data_cfg, test_crops=crops), training=False)
        infos = {name: probe(path, data_cfg.decoder) for name, path in record.views.items()}
        self.plans = self.transform.plan([info.frame_size() for info in infos.values()], None, self.crop or 0)
        self.copies = PreparedCopies(data_cfg)  # data.prepared_dir: each view's copy, where one matches
        read_from = {name: self.copies.read_from(path, infos[name]) for name, path in record.views.items()}
        for path, why in self.copies.missing.items():
            if path not in _SAID_MISSING:  # once per file: evaluation streams a video's windows one by one
                _SAID_MISSING.add(path)
                log.info("%s: no usable prepared copy (%s): read from the source", path, why)
        self.readers = {
            name: open_reader(
                read_from[name][0],
                plan.decoded,
                threads=spec.decode_threads,
                info=read_from[name][1],
                decoder=data_cfg.decoder,
                access="sequential",
            )
            for plan, name in zip(self.plans, record.views)
        }
        for reader in self.readers.values():
            for note in filter(None, (several_streams_note(reader.info), reader.info.header_note())):
                log.warning("%s", note)
            # a container can over-state its length (a cut file keeps its header): reading the last frame it
            # claims finds the real end, so no chunk is made of the last frame repeated
            self.waiting_for = f"its last frame ({reader.num_frames - 1})"
            reader.read([reader.num_frames - 1])
        end = min(r.num_frames for r in self.readers.values())
        if self.last is not None:
            end = min(end, self.last)
        if end <= self.first:
            raise VideoReadError(
                f"{record.first_path}: the video ends at frame {end}, before its sample window "
                f"[{self.first}, {self.last})"
            )
        self.num_frames = end - self.first  # the video frames streamed, from self.first
        self.fps = next(iter(infos.values())).fps  # the source's: a copy's rate is it to 1/1001
        self.stride = video_stride(data_cfg.frame_stride, data_cfg.fps, self.fps)  # data.fps: this video's own
        clip_length = len(range(0, self.num_frames, self.stride))
        self.windows = inference_windows(clip_length, spec.chunk, spec.overlap, spec.aggregation)
        self.batch, self.load_rgb, self.load_kpt = spec.batch, data_cfg.load_rgb, data_cfg.load_kpt
        if self.load_kpt and record.keypoints is None:
            raise KeypointError(
                f"{record.where}: the model needs keypoints but the input has none "
                f"(give a manifest line with 'keypoints')"
            )

    def _produce(self) -> None:
        try:
            cache: dict[int, list] = {}  # clip frame -> each view's frame: the overlap, decoded once
            for first in range(0, len(self.windows), self.batch):
                if self.stopping.is_set():
                    return
                group = self.windows[first : first + self.batch]
                self.waiting_for = (
                    f"inference chunks {group[0][0]}..{group[-1][1]} (clip frames; video frames "
                    f"{self.video_frame(group[0][0])}..{self.video_frame(group[-1][1] - 1) + 1})"
                )
                tick = time.perf_counter()
                new = sorted({i for s, e in group for i in range(s, e)} - cache.keys())
                if self.load_rgb and new:  # datasets.decode.read_clip: the dataset's path from file to frames
                    views = read_clip(
                        list(self.readers.values()), [self.video_frame(i) for i in new], self.plans, self.transform
                    )
                    for t, i in enumerate(new):
                        cache[i] = [view[:, t] for view in views]  # each [C, H, W]
                tensors = {}
                if self.load_rgb:
                    channels, height, width = cache[group[0][0]][0].shape
                    length = group[0][1] - group[0][0]
                    video = torch.empty(
                        (len(group), len(self.readers), channels, length, height, width), dtype=torch.uint8
                    )
                    for k, (s, e) in enumerate(group):  # one copy from the cache into the batch
                        for t, i in enumerate(range(s, e)):
                            for v, frame in enumerate(cache[i]):
                                video[k, v, :, t] = frame
                    tensors["video"] = video[:, 0] if len(self.readers) == 1 else video  # [n, (V,) C, L, H, W]
                if self.load_kpt:
                    tensors["kpt"] = torch.stack([torch.from_numpy(self._keypoints(s, e)) for s, e in group])
                following = first + self.batch
                keep_from = self.windows[following][0] if following < len(self.windows) else float("inf")
                for i in [i for i in cache if i < keep_from]:
                    del cache[i]
                self.decode_seconds += time.perf_counter() - tick
                self._put((group, tensors))
            self._put(None)
        except BaseException as e:  # hand the error to the consumer
            self._put(e)

    def _keypoints(self, start: int, end: int) -> np.ndarray:
        """The keypoints of clip frames [start, end), following the first view's crop (as in training)."""
        indices = [self.video_frame(i) for i in range(start, end)]
        return read_clip_keypoints(self.record, indices, self.plans if self.load_rgb else [], self.transform)

    def video_frame(self, clip_frame: int) -> int:
        return self.first + clip_frame * self.stride

    def _put(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _get(self):
        """The thread's next item, waiting at most data.sample_timeout_s for it."""
        try:
            return self.queue.get(timeout=self.timeout)
        except queue.Empty:
            return StalledFile(
                f"{self.record.first_path}: no answer within {self.timeout:g} s while reading "
                f"{self.waiting_for} (data.sample_timeout_s): a stalled mount or a decoder that "
                f"does not return"
            )

    def __iter__(self):
        while True:
            item = self._get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop the decoding thread (also when the consumer failed half-way), then release the files. A thread
        blocked in the decoder past the deadline is left behind with its files."""
        self.stopping.set()
        self.thread.join(timeout=self.timeout)
        if not self.thread.is_alive():
            for reader in self.readers.values():
                reader.close()
