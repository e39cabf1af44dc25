"""eval.py's and infer_chunked.py's shared flags over a checkpoint's config: their one definition
(``add_inference_flags``), the config keys they set (``INFERENCE_FLAGS``) and the overrides they make
(``inference_overrides``), applied and validated by ``apply_inference_flags``."""

from __future__ import annotations

import argparse
from typing import Any

from config.schema import SCHEMA, Config
from config.validation import apply_flags
from core.errors import ConfigError

# The one table from the scripts' flags to the config keys they override (clip flags: eval.py's alone).
INFERENCE_FLAGS = {
    "--chunk": "infer.chunk_size",
    "--overlap": "infer.chunk_overlap",
    "--agg": "infer.chunk_aggregation",
    "--batch": "infer.chunks_per_forward",
    "--head-chunks": "infer.head_chunks",
    "--sample-timeout": "data.sample_timeout_s",
    "--prepared": "data.prepared_dir",
    "--num-frames": "data.num_frames",
    "--crops": "data.test_crops",
    "--clips": "data.test_clips",
}
CLIP_FLAGS = ("--num-frames", "--crops", "--clips")


def add_inference_flags(parser: argparse.ArgumentParser, clips: bool = False) -> None:
    """The flags both scripts take: the inference chunk, the head's span, chunks per forward (``--batch N|auto``)
    and its budget, the sample deadline, the device, precision and backbone; with ``clips``, eval.py's clip flags
    (--num-frames, --crops, --clips). Each defaults to the checkpoint's setting."""
    parser.add_argument(
        "--backbone",
        metavar="PATH",
        help="a temporal head trained on features (data.features_dir) runs with the backbone "
        "checkpoint that wrote them, found where it was; give it here if it moved (its sha256 "
        "is checked)",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        help="clip frames per inference chunk; -1 = the whole clip or video at "
        "once (default: the checkpoint's infer.chunk_size)",
    )
    parser.add_argument(
        "--overlap", type=int, help="clip frames shared by consecutive chunks (default: infer.chunk_overlap)"
    )
    parser.add_argument(
        "--agg",
        choices=SCHEMA["infer"]["chunk_aggregation"].choices,
        help="without a temporal head: how chunk logits are aggregated (default: infer.chunk_aggregation)",
    )
    parser.add_argument(
        "--head-chunks",
        type=head_chunks,
        metavar="N|auto|-1",
        help="the most chunks a temporal head sees for a chunk's output; a longer video runs in spans of N "
        "chunks overlapping by half (default: infer.head_chunks, auto: as many as its "
        "longest training clip; -1: the whole video at once)",
    )
    parser.add_argument(
        "--batch",
        type=chunks_or_auto,
        metavar="N|auto",
        help="inference chunks per forward call, for every evaluated clip of a sample window at once (default: "
        "infer.chunks_per_forward); auto = the most whose estimated device memory fits "
        "--memory-budget-gb (the memory planner)",
    )
    parser.add_argument(
        "--memory-budget-gb",
        type=float,
        help="the memory --batch auto fits (default: the checkpoint's trainer.memory_budget_gb)",
    )
    parser.add_argument(
        "--sample-timeout",
        type=float,
        metavar="SECONDS",
        help="seconds a video's header, a sample or one group of chunks may take to decode before "
        "the video counts as unreadable (default: the checkpoint's data.sample_timeout_s)",
    )
    parser.add_argument(
        "--prepared",
        metavar="DIR",
        help="read each video's prepared copy from DIR where one matches it and the checkpoint's decode size "
        "(python -m datasets.prepare; default: the checkpoint's data.prepared_dir)",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--precision", help="32, 16, bf16 or amp (default: the checkpoint's)")
    if clips:
        parser.add_argument("--num-frames", type=int, help="frames per clip (-1 = the whole sample window)")
        parser.add_argument(
            "--crops",
            type=int,
            help="spatial crops per clip: 1 (the centre) or 3 (along the long "
            "side, each an evaluated clip; video accuracy averages them "
            "all)",
        )
        parser.add_argument(
            "--clips",
            type=int,
            help="temporal clips per sample window, evenly spaced "
            "(data.test_clips), each times --crops: --clips 10 --crops 3 "
            "is the 30-clip protocol of Kinetics-style tables",
        )


def head_chunks(text: str) -> int | str:
    """--head-chunks's value: auto or a number of chunks (-1: all)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--head-chunks {text}: expected a number of chunks, -1 (the whole video) or auto")


def chunks_or_auto(text: str) -> int | str:
    """--batch's value: auto or a number of chunks."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--batch {text}: expected a number of chunks, or auto")


def inference_overrides(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """The inference flags given on the command line, as ``{config key: (flag, value)}`` (``--batch auto`` is not
    a value: the planner sizes it once the model is loaded)."""
    given = {flag: getattr(args, flag[2:].replace("-", "_"), None) for flag in INFERENCE_FLAGS}
    return {
        INFERENCE_FLAGS[flag]: (flag, value)
        for flag, value in given.items()
        if value is not None and not (flag == "--batch" and value == "auto")
    }


def apply_inference_flags(cfg: Config, overrides: dict[str, tuple[str, Any]]) -> Config:
    """A validated copy of ``cfg`` with ``{"infer.chunk_size": ("--chunk", 32), ...}`` applied; errors name the
    flag."""
    head = cfg.model.temporal_head
    flag, value = overrides.get("infer.chunk_aggregation", (None, None))
    if value is not None and head != "none":
        raise ConfigError(
            f"{flag} {value}: this model has a temporal head (model.temporal_head: {head}), which is the "
            f"aggregation over its chunks; leave {flag} out"
        )
    return apply_flags(cfg, overrides)
