"""Classify long videos in inference chunks, streamed from the file: memory does not depend on video length.

    python infer_chunked.py --chunk 32 --overlap 8
    python infer_chunked.py --checkpoint best.pt --input video.mp4 --agg prob --timeline --output out.jsonl

Without --checkpoint, the best checkpoint of the most recent run under runs/ is used; without --input,
the test (else val) manifest of that checkpoint's config. Chunk and overlap count clip frames, that is
frames at the checkpoint's data.frame_stride. A background thread decodes the next inference chunks
while the model runs the current ones; frames shared by overlapping chunks are decoded once.

The chunked evaluator is this file: ``classify_video`` (the loop over a video's inference chunks), ``run_videos``
(the loop over the input's videos) and ``main`` (wiring). Decoding (datasets.chunk_stream), the model's loading
(artifacts.trained_model) and what is written (engine.inference) are calls.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NamedTuple

import torch
from tqdm import tqdm

from artifacts.checkpoint import CheckpointError
from artifacts.run_dir import ExperimentDirectory, most_recent_best
from artifacts.timeline_plot import ROW_MINUTES
from artifacts.trained_model import load_trained_model
from config import Config, add_inference_flags, apply_inference_flags, inference_overrides, load_config
from core import memory_monitor
from core.cli import exit_on_usage_error
from core.errors import UsageError
from core.files import file_sha256
from core.logs import setup_logging
from core.runtime import resolve_device, setup_runtime
from core.shards import parse_shard, shard
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.chunk_stream import ChunkStream
from datasets.device_input import DeviceInputs
from datasets.manifest import VideoRecord
from datasets.mstcn import check_one_word
from datasets.records import check_labels, resolve_inputs
from datasets.shape import DataShape
from datasets.video.capture import quiet_decoder_logs
from engine.inference.chunks import ChunkOutputs
from engine.inference.features import (
    FEATURE_DTYPES,
    FEATURE_LAYOUTS,
    FeatureOutput,
    feature_names,
    make_features_directory,
    settings_of,
    write_mstcn_index,
)
from engine.inference.stream import InferenceSpec, StreamedGroups, how_it_runs, video_result
from engine.inference.video_outputs import Outputs, print_result, video_key
from engine.inference.video_result import VideoResult
from engine.inference.video_runs import Tally, go_on_after, save_features
from engine.metrics.segments import SegmentationScores, background_indices
from models import set_head_chunks
from planner.batch_size import inference_batch_for_budget


@torch.inference_mode()
def classify_video(
    model,
    record: VideoRecord,
    data_cfg,
    spec: InferenceSpec,
    runtime,
    device_inputs: DeviceInputs,
    class_names: list[str],
    keep_features: bool = False,
    scores: SegmentationScores | None = None,
) -> VideoResult:
    """One video through the model in inference chunks as they are decoded: ``spec.chunk`` clip frames each,
    ``spec.overlap`` of them shared with the chunk before, ``spec.batch`` chunks a forward. Without a temporal head
    each group's logits are aggregated as they come (``spec.aggregation``: mean, max, last or prob); with one, each
    chunk's features are kept on the host and the head runs once over them all at the end. Its result: the top-k
    labels, and with ``spec.timeline`` every chunk's and the per-frame timeline (``video_result``)."""
    check_labels(record, class_names, unlabelled_ok=True)  # the checks and messages of train.py and eval.py
    stream = ChunkStream(record, data_cfg, spec)  # the chunks, decoded on a thread a few ahead of the model
    try:
        outputs = ChunkOutputs(model, spec.aggregation, stream.stride, keep_features, features_on_host=True)
        groups = StreamedGroups(stream, device_inputs, getattr(model, "min_frames", 1))
        started = time.perf_counter()
        with runtime.autocast():
            for windows, inputs in groups:  # [start, end) clip frames of each chunk; inputs [n, (V,) C, L, H, W]
                outputs.add(windows, inputs)  # the forward: logits aggregated, or features kept for the head
            out = outputs.result(stream.windows)  # the video's logits: the aggregation, or the head over all
        compute_seconds = time.perf_counter() - started - groups.waited  # not waiting for the decoder
        return video_result(record, stream, out, compute_seconds, spec, class_names, scores, keep_features)
    finally:
        stream.close()


def run_videos(
    model,
    records: list,
    names: list[str],
    cfg: Config,
    spec: InferenceSpec,
    runtime,
    class_names,
    outputs: Outputs,
    features: FeatureOutput | None,
) -> int:
    """Each video classified (and with ``features``, its features written, or skipped when already there); prints
    each result and the summary; returns the number that failed. A video that cannot be read is one error line and
    the others go on; a stalled file ends the run."""
    device_inputs = DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std)
    scores = SegmentationScores(background_indices(cfg.data.background_labels, class_names))
    tally = Tally()
    written = {video_key(row["video"]) for row in tally.resumed(outputs.resume(scores), outputs.output)}
    progress = tqdm(names, desc="videos", disable=not sys.stderr.isatty() or len(records) == 1)
    for number, (record, name) in enumerate(zip(records, progress)):
        if video_key(record.video) in written:
            continue  # in --output already, from a run that stopped
        reason = features.done(name) if features else "new"
        if reason is None:
            print(
                f"skipped {record.first_path}: {os.path.join(features.directory, name)} exists with the same settings"
            )
            tally.counts["skipped"] += 1
            continue
        try:
            keep = features is not None
            result = classify_video(model, record, cfg.data, spec, runtime, device_inputs, class_names, keep, scores)
        except BAD_INPUT_ERRORS as e:
            if len(records) == 1:
                raise
            if not go_on_after(e, len(records) - number - 1, tally):
                break
            result = VideoResult(record.first_path, error=str(e))
        if features and result.error is None:
            save_features(name, result, record, cfg, features, class_names, reason, tally)
        tally.add(result)
        outputs.write(result, name, class_names)
        if result.error is None:  # the console shows the summary with --output too
            print_result(result, spec.timeline)
        print(tally.progress(number + 1, len(records)))
    for line in tally.summary(scores, features is not None):
        print(line)
    if features and features.layout != "npz":
        labelled = any(r.segments is not None for r in records)
        listed = write_mstcn_index(features, class_names, labelled)
        print(
            f"MS-TCN's layout: {features.directory}/splits/{features.bundle}.bundle lists {len(listed)} of the "
            f"{len(features.all_names)} videos" + (", mapping.txt its classes" if labelled else "")
        )
    if scores.videos:
        outputs.write_scores(scores.result(), scores.videos)
    return tally.counts["failed"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint",
        help="checkpoint (default: best.pt of the experiment of --config, else the most recent best.pt in --runs)",
    )
    parser.add_argument("--config", help="a training preset: its experiment's latest run gives the checkpoint")
    parser.add_argument("--runs", default="runs", help="where to look for the most recent run")
    parser.add_argument("--input", help="a video file, a directory of videos, or a manifest (.jsonl/.csv)")
    add_inference_flags(parser)
    parser.add_argument("--topk", type=int, default=3, help="labels reported per video")
    add_output_flags(parser)
    add_feature_flags(parser)
    args = parser.parse_args(argv)
    if args.topk < 1:
        raise UsageError(f"--topk {args.topk}: must be >= 1")
    if args.plot and not args.timeline:
        raise UsageError(f"--plot {args.plot}: plots a timeline; add --timeline")
    if not args.plot_row_minutes > 0:
        raise UsageError(
            f"--plot-row-minutes {args.plot_row_minutes:g}: give the minutes of video a row shows, "
            f"more than 0 (default {ROW_MINUTES:g})"
        )
    return args


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """What infer_chunked.py writes and draws of each video, and how it reads them."""
    parser.add_argument(
        "--output",
        metavar="OUT.jsonl",
        help="write one JSON line per video to OUT.jsonl and a row to OUT.csv (video, label, the top-k labels "
        "and probabilities); with --timeline also its segments, and OUT_frames.csv: every frame's label; with "
        "annotated segments, OUT_scores.json: the timeline scores over all videos. Run again with the same "
        "checkpoint and settings, it goes on where the files end: the videos already there are skipped",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="per-frame timelines: every chunk's result, and the segments of the frames' labels (each "
        "frame's probabilities blended from the chunks that cover it)",
    )
    parser.add_argument(
        "--plot",
        metavar="DIR",
        help="with --timeline: DIR/<video stem>.png per video, ground truth "
        "(where annotated) above the prediction and the frames where "
        "they disagree, in rows of --plot-row-minutes",
    )
    parser.add_argument(
        "--plot-row-minutes",
        type=float,
        default=ROW_MINUTES,
        metavar="M",
        help=f"--plot: minutes of video a row (default {ROW_MINUTES:g}; at most 24 rows: a longer "
        f"video gets longer rows)",
    )
    parser.add_argument(
        "--decode-threads", type=int, default=0, help="FFmpeg decoder threads (0 = OpenCV's choice, all cores)"
    )
    parser.add_argument("--max-videos", type=int, help="stop after this many videos")


def add_feature_flags(parser: argparse.ArgumentParser) -> None:
    """--features DIR: the per-chunk features of each video, and the shard of the input this process takes."""
    parser.add_argument(
        "--features",
        metavar="DIR",
        help="also write each video's per-chunk features to DIR/<stem>.npz (docs/inference.md); a "
        "video whose file is there with the same settings is skipped",
    )
    parser.add_argument(
        "--features-dtype",
        choices=FEATURE_DTYPES,
        default="float16",
        help="dtype of the stored features (the logits are always float32)",
    )
    parser.add_argument(
        "--features-layout",
        choices=FEATURE_LAYOUTS,
        default="npz",
        help="npz: DIR/<stem>.npz; mstcn: MS-TCN's layout instead (DIR/features/<stem>.npy [D, n] float32, with "
        "segments DIR/groundTruth/<stem>.txt and DIR/mapping.txt, DIR/splits/<input>.bundle), for MS-TCN, "
        "ASFormer or DiffAct code unchanged; both: the two",
    )
    parser.add_argument(
        "--features-bundle",
        metavar="NAME",
        help="--features-layout mstcn or both: the bundle's name, DIR/splits/NAME.bundle (e.g. train.split1, "
        "as MS-TCN's main.py looks for it; default: the --input file's name)",
    )
    parser.add_argument(
        "--shard",
        metavar="i/N",
        help="take every N-th video from the i-th (0-based): N processes or machines split the input",
    )


def inference_config(args, cfg: Config, runtime, shape: DataShape) -> Config:
    """The checkpoint's config with the flags applied, validated by config (its messages name the flag); with
    --batch auto, the most chunks per forward that fit the budget. What runs is this config: the features files
    store it, and the InferenceSpec is read from it."""
    cfg = apply_inference_flags(cfg, inference_overrides(args))
    if args.batch == "auto":
        batch = inference_batch_for_budget(cfg, runtime, shape, args.memory_budget_gb)
        cfg = apply_inference_flags(cfg, {"infer.chunks_per_forward": ("--batch auto", batch)})
    return cfg


def find_checkpoint(args) -> tuple[str, str]:
    """(checkpoint, why it was chosen): --checkpoint; the latest run of --config's experiment; or the most recently
    written best.pt of any experiment under --runs (the last one trained)."""
    if args.checkpoint:
        return args.checkpoint, "--checkpoint"
    if args.config:
        cfg = load_config(args.config)
        path = ExperimentDirectory.of_config(cfg).latest_best(f"--config {args.config}")
        return path, f"the latest run of experiment '{cfg.experiment}' ({args.config})"
    return most_recent_best(args.runs), (
        f"the most recently written best.pt under {args.runs}/ (--config or --checkpoint to choose another)"
    )


class Inputs(NamedTuple):
    source: str  # where the videos come from
    records: list  # this shard's
    names: list  # their features files' names
    part: str  # the shard in words
    all_names: list  # every shard's features files' names


def input_records(args, cfg: Config, shard_index: int, shard_count: int) -> Inputs:
    source, records = resolve_inputs(args.input, cfg.data)
    if args.max_videos:
        records = records[: args.max_videos]
    all_names = feature_names(records)  # over the whole list: every shard names a file alike
    records, names = shard(records, shard_index, shard_count), shard(all_names, shard_index, shard_count)
    return Inputs(source, records, names, f", shard {shard_index}/{shard_count}" if shard_count > 1 else "", all_names)


def feature_output(args, cfg: Config, checkpoint_path: str, class_names: list, all_names: list) -> FeatureOutput | None:
    """--features DIR: where each video's file goes, the settings that decide it, the layout; ``all_names``: every
    video's file name of the input list (all shards)."""
    if not args.features:
        return None
    settings = settings_of(
        cfg, cfg.infer.chunk_size, cfg.infer.chunk_overlap, args.features_dtype, file_sha256(checkpoint_path)
    )
    if args.features_layout != "npz":
        check_one_word(class_names)  # before the first video, not after the last
    bundle = args.features_bundle or (
        os.path.splitext(os.path.basename(os.path.normpath(args.input)))[0] if args.input else "videos"
    )
    return FeatureOutput(args.features, settings, checkpoint_path, args.features_layout, bundle, tuple(all_names))


def prediction_settings(args, cfg: Config, checkpoint_path: str) -> dict:
    """What decides --output's rows: a rerun with other settings does not append to them."""
    if not args.output:
        return {}
    settings = settings_of(cfg, cfg.infer.chunk_size, cfg.infer.chunk_overlap, "", file_sha256(checkpoint_path))
    del settings["dtype"]
    infer = cfg.infer
    return settings | {
        "aggregation": infer.chunk_aggregation,
        "head_chunks": infer.head_chunks,
        "topk": args.topk,
        "timeline": args.timeline,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    quiet_decoder_logs()
    shard_index, shard_count = parse_shard(args.shard)  # a bad --shard is refused before the model loads
    if args.features:
        make_features_directory(args.features)
    checkpoint_path, why = find_checkpoint(args)
    device = resolve_device(args.device or "auto")
    model, cfg, class_names, saved = load_trained_model(checkpoint_path, device, args.backbone)
    if saved.features is not None:
        raise UsageError(
            f"{checkpoint_path}: a head trained on the features of an MS-TCN dataset ({saved.features['dataset']}) "
            f"has no backbone to run videos with; eval.py --checkpoint {checkpoint_path} scores it on its split's "
            f"test videos"
        )
    if cfg.train.objective == "motion" and not args.features:
        raise UsageError(
            f"{checkpoint_path}: a backbone pretrained without labels (train.objective: motion) predicts no class; "
            f"fine-tune it with --set model.pretrained={checkpoint_path}, or write its chunk features with "
            f"--features DIR"
        )
    if saved.backbone is not None:
        why += f"; its backbone: {saved.backbone}"
    runtime = setup_runtime(cfg.trainer, device=str(device), precision=args.precision)
    cfg = inference_config(args, cfg, runtime, saved.shape)
    head_reach = set_head_chunks(model, cfg.infer.head_chunks)
    spec = InferenceSpec.of_config(cfg.infer, args.topk, args.timeline, args.decode_threads or None)
    source, records, names, part, all_names = input_records(args, cfg, shard_index, shard_count)
    print(
        f"checkpoint: {checkpoint_path} ({why})\ninput: {source} ({len(records)} videos{part})\n"
        f"{how_it_runs(cfg, head_reach)} batch {spec.batch} on {runtime.device}"
    )
    if cfg.data.prepared_dir:
        print(f"videos: their prepared copies in {cfg.data.prepared_dir} where one matches, else the sources")
    if runtime.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(runtime.device)
    outputs = Outputs(
        args.output, args.plot, args.timeline, prediction_settings(args, cfg, checkpoint_path), args.topk,
        args.plot_row_minutes,
    )  # fmt: skip
    failures = run_videos(
        model,
        records,
        names,
        cfg,
        spec,
        runtime,
        class_names,
        outputs,
        feature_output(args, cfg, checkpoint_path, class_names, all_names),
    )
    snap = memory_monitor.snapshot(runtime.device)
    peak = f", device peak {snap['device_peak_mb']:.0f} MB" if "device_peak_mb" in snap else ""
    print(f"peak memory: host RSS {memory_monitor.host_peak_rss_mb():.0f} MB{peak}")
    return 1 if failures else 0


if __name__ == "__main__":
    exit_on_usage_error(
        main,
        BAD_INPUT_ERRORS + (CheckpointError,),
        disk_advice="free space there and run the same command again: with --features, the videos "
        "whose files are written are skipped",
    )
