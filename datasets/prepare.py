"""Prepare a config's videos once, for reading many times: ``python -m datasets.prepare --config CONFIG``.

Every video of the config's manifests (data.train_manifest, val_manifest, test_manifest; each view of a
multi-view sample) gets a copy in ``data.prepared_dir`` at the size this config decodes it to, turned as
displayed, with a keyframe every 16 frames (``datasets.video.prepared``). Training, evaluation,
eval.py, infer_chunked.py and its --features then read the copy wherever it matches the source and these settings.

Before it starts it says how much it will write and how long it will take (from preparing the first video's
first frames); after, what it took. A video whose copy is there is skipped; a changed source, or other settings, is
prepared again. ``--shard i/N`` splits the videos between N processes or machines; a stopped run continues when
run again (each copy is written atomically, its record last).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time

from config import Config, load_config
from core.cli import add_config_arguments, exit_on_usage_error
from core.errors import UsageError
from core.files import free_space_text
from core.shards import parse_shard, shard
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.manifest import read_manifest
from datasets.prepared_copies import preparation_of
from datasets.records import manifest_path, read_split
from datasets.video.choice import open_reader
from datasets.video.index_cache import VideoIndexCache
from datasets.video.info import VideoInfo, VideoReadError
from datasets.video.prepared import Preparation, find_copy, prepare_copy
from datasets.video.probe import frame_times

TRIAL_FRAMES = 240  # frames of the first video prepared to time the rest
SPLITS = ("train", "val", "test")


def config_videos(cfg: Config) -> list[str]:
    """Every video path of the config's manifests that exist, each once, in manifest order; with none there, the
    training manifest's error (naming the key and the forms it takes)."""
    manifests = [p for p in (manifest_path(cfg.data, split) for split in SPLITS) if p is not None and os.path.exists(p)]
    if not manifests:
        read_split(cfg.data, "train")  # raises: not set, or not found
    paths: dict[str, None] = {}
    for manifest in manifests:
        for record in read_manifest(manifest, labelled=False):  # only its videos are read
            paths.update(dict.fromkeys(record.views.values()))
    return list(paths)


def prepare_one(
    path: str, info: VideoInfo, folder: str, preparation: Preparation, decoder: str, frames: int | None = None
):
    """``path``'s copy in ``folder`` (the whole video, or its first ``frames`` for the timing trial), decoded by
    ``decoder`` (data.decoder) and turned as the preparation says."""
    size, turned = (preparation.height, preparation.width), preparation.orientation != "none"
    with open_reader(path, size, 1, info, decoder, access="sequential", autorotate=turned) as r:
        if frames is not None:
            r.num_frames = min(r.num_frames, frames)
        return prepare_copy(r, folder, preparation, frame_times(path))


def estimate(todo: list[tuple[str, VideoInfo, Preparation]], decoder: str) -> tuple[float, float]:
    """(seconds, bytes) to prepare ``todo``, from two trials on the first video into a temporary folder: its first
    frame alone (what each video costs whatever its length: opening, probing its times, starting the encoder) and
    its first TRIAL_FRAMES frames (seconds per source pixel decoded beyond that, bytes per copy pixel written)."""
    path, info, preparation = todo[0]
    trial = tempfile.mkdtemp(prefix="prepare-trial-")
    try:
        timed = []
        for frames in (1, TRIAL_FRAMES):
            start = time.perf_counter()
            copy = prepare_one(path, info, os.path.join(trial, str(frames)), preparation, decoder, frames)
            timed.append((time.perf_counter() - start, copy))
    finally:
        shutil.rmtree(trial, ignore_errors=True)
    (per_video, _), (seconds, copy) = timed
    frames = copy.info.num_frames
    per_source_pixel = max(0.0, seconds - per_video) / max(1, frames - 1) / (info.width * info.height)
    per_copy_pixel = copy.record["bytes"] / (frames * preparation.width * preparation.height)
    source_pixels = sum(i.num_frames * i.width * i.height for _, i, _ in todo)
    copy_pixels = sum(i.num_frames * p.width * p.height for _, i, p in todo)
    return per_video * len(todo) + per_source_pixel * source_pixels, per_copy_pixel * copy_pixels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--shard", metavar="i/N", help="take every N-th video from the i-th (0-based)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shard_index, shard_count = parse_shard(args.shard)
    cfg = load_config(args.config, args.overrides)
    folder = cfg.data.prepared_dir
    if folder is None:
        raise UsageError(
            f"{args.config}: data.prepared_dir is not set; give the folder the copies go to, "
            f"e.g. --set data.prepared_dir=/data/prepared (and the same key when training)"
        )
    paths = shard(config_videos(cfg), shard_index, shard_count)
    cache = VideoIndexCache(os.path.join(folder, ".video_index.json"))
    todo, done, failed = [], 0, []
    for path in paths:
        try:
            info = cache.info(path, cfg.data.decoder)
        except VideoReadError as e:
            failed.append(str(e))  # names the file
            continue
        preparation = preparation_of(info, cfg.data)
        if find_copy(folder, path, preparation)[0] is not None:
            done += 1
        else:
            todo.append((path, info, preparation))
    os.makedirs(folder, exist_ok=True)
    cache.save()
    part = f" (shard {shard_index}/{shard_count})" if shard_count > 1 else ""
    hours = sum(i.num_frames / i.fps for _, i, _ in todo) / 3600
    print(f"{len(paths)} videos{part}: {done} prepared already, {len(todo)} to prepare ({hours:.2f} h of video)")
    if todo:
        seconds, size = estimate(todo, cfg.data.decoder)
        print(
            f"estimated: {size / 1e9:.3f} GB in {folder} ({free_space_text(folder)}) and {seconds:.0f} s "
            f"({seconds / 3600:.2f} h), from two trials on the first video (its first frame, its first {TRIAL_FRAMES})"
        )
    else:
        seconds, size = 0.0, 0.0
    start, written, prepared = time.perf_counter(), 0, 0
    for k, (path, info, preparation) in enumerate(todo, 1):
        try:
            copy = prepare_one(path, info, folder, preparation, cfg.data.decoder)
        except VideoReadError as e:
            failed.append(str(e))
            print(f"[{k}/{len(todo)}] failed: {e}")
            continue
        written, prepared = written + copy.record["bytes"], prepared + 1
        print(
            f"[{k}/{len(todo)}] {path}: {copy.info.num_frames} frames at {preparation.width}x{preparation.height} "
            f"-> {copy.path} ({copy.record['bytes'] / 1e6:.1f} MB)"
        )
    if todo:
        print(
            f"prepared {prepared} videos: {written / 1e9:.3f} GB in {time.perf_counter() - start:.0f} s "
            f"(estimated {size / 1e9:.3f} GB in {seconds:.0f} s)"
        )
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS, disk_advice="free space there and run the same command again")
