"""Command-line flags over a checkpoint's config: eval.py's and infer_chunked.py's flags and the keys they set."""
from __future__ import annotations

import argparse

from config.schema import Config
from config.validation import apply_flags
from core.errors import ConfigError

# The one table from eval.py's and infer_chunked.py's flags to the config keys they override.
INFERENCE_FLAGS = {
    "--chunk": "train.chunk_infer_size",
    "--overlap": "train.chunk_overlap",
    "--agg": "train.chunk_aggregation",
    "--batch": "train.video_batch_size",
    "--num-frames": "data.num_frames",
    "--crops": "data.test_crops",
    "--clips": "data.test_clips",
    "--sample-timeout": "data.sample_timeout_s",
    "--head-window": "model.temporal_window",
}


def add_head_window_flag(parser: argparse.ArgumentParser) -> None:
    """--head-window, as eval.py and infer_chunked.py both take it (model.temporal_window)."""
    parser.add_argument("--head-window", type=head_window, metavar="N|auto|-1",
                        help="the most chunks a temporal head sees at once; a longer video runs in windows of N "
                             "chunks overlapping by half (default: model.temporal_window, auto: as many as its "
                             "longest training clip; -1: the whole video at once)")


def head_window(text: str) -> int | str:
    """--head-window's value: auto or a number of chunks (-1: all)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--head-window {text}: expected a number of chunks, -1 (the whole video) or auto")


def apply_inference_flags(cfg: Config, values: dict) -> Config:
    """A validated copy of ``cfg`` with ``{"--chunk": 32, ...}`` applied (None leaves the key); errors name
    the flag."""
    head = cfg.model.temporal_head
    if values.get("--agg") is not None and head != "none":
        raise ConfigError(f"--agg {values['--agg']}: this model has a temporal head (model.temporal_head: {head}), "
                          f"which is the aggregation over its chunks; leave --agg out")
    return apply_flags(cfg, {INFERENCE_FLAGS[flag]: (flag, value) for flag, value in values.items()})
