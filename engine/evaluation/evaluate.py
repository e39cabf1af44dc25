"""The one evaluation loop (``evaluate``: training's validation, eval.py and ``eval.py --watch``), and what eval.py
makes of a dataset with it: metrics, per-clip and per-video rows, the printed report, the files."""

from __future__ import annotations

import csv
import io
import json
import logging
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from artifacts.trained_model import CheckpointSummary
from config import Config, InferConfig
from core import watchdog
from core.errors import UsageError
from core.files import atomic_write_bytes
from core.runtime import Runtime, setup_runtime, unwrap_model
from datasets.bad_input import BAD_INPUT_ERRORS, BadInputReport
from datasets.chunk_stream import ChunkStream
from datasets.device_input import DeviceInputs
from datasets.records import frame_labels
from datasets.sample import Sample
from datasets.video_dataset import VideoWindowDataset
from engine.data.feature_files import feature_loader, test_videos
from engine.data.loaders import GuardedBatches, make_loader
from engine.inference.chunks import ChunkedOutput, forward_chunked
from engine.inference.stream import InferenceSpec, run_stream
from engine.inference.timeline import annotated, frame_probabilities
from engine.metrics.clips import ClassificationMeter
from engine.metrics.segments import SegmentationScores, background_indices, format_scores

log = logging.getLogger("longvideo")


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module,
    loader: DataLoader,
    device_inputs: DeviceInputs,
    runtime: Runtime,
    infer_cfg: InferConfig,
    num_classes: int,
    bad_inputs: BadInputReport | None = None,
    meter: ClassificationMeter | None = None,
    on_clips=None,
    frame_stride: int = 1,
    background: tuple = (),
) -> dict:
    """Clip- and video-level metrics with the shared chunked forward; predictions move to the CPU at once.
    The one evaluation loop: training's validation and eval.py (which passes its own ``meter``, for the
    per-video rows, and ``on_clips(batch, logits)`` for the per-clip ones).

    Clips with frame labels (a manifest with segments) are also scored as timelines (engine.metrics.segments:
    "seg_frame_acc", "seg_edit", "seg_f1@10/25/50" over the annotated frames, ``background``: the class indices
    edit and F1 leave out), each clip's per-frame labels blended from its chunks' predictions.

    Under DDP each rank evaluates its shard and the CPU meters are gathered, so every rank gets the metrics
    of the whole validation set.
    """
    model = unwrap_model(model)  # no DDP collectives here: shards may differ in length
    model.eval()
    meter = meter if meter is not None else ClassificationMeter(num_classes)
    timelines = SegmentationScores(background)
    for batch, logits, chunked in clip_predictions(
        model, loader, device_inputs, runtime, infer_cfg, bad_inputs, frame_stride
    ):
        watchdog.beat()  # a validation batch under torchrun: progress
        meter.update(logits, batch["label"], batch["video_index"])
        if chunked is not None:
            score_clip_timelines(timelines, chunked, batch["frame_labels"])
        if on_clips is not None:
            on_clips(batch, logits)
    if runtime.distributed:
        meters, parts = [None] * runtime.world_size, [None] * runtime.world_size
        torch.distributed.all_gather_object(meters, meter)
        torch.distributed.all_gather_object(parts, timelines)
        meter, timelines = ClassificationMeter.merged(meters), SegmentationScores.merged(parts)
    metrics = meter.compute()
    if timelines.videos:
        metrics.update({f"seg_{k}": v for k, v in timelines.result().items()}, seg_clips=timelines.videos)
    return metrics


def clip_predictions(
    model,
    loader: DataLoader,
    device_inputs: DeviceInputs,
    runtime: Runtime,
    infer_cfg: InferConfig,
    bad_inputs: BadInputReport | None,
    frame_stride: int,
):
    """(batch, clip logits [B, K] on the CPU, the ChunkedOutput where the batch has annotated frames, else None)
    for the loader's samples in order: clips decoded by the loader and put
    through ``forward_chunked``; or, where each clip is a whole sample window (data.num_frames -1: a head on
    features paired with its backbone, ``eval.py --num-frames -1``), each sample the loader's sampler gives this
    rank streamed from its file (``streamed_predictions``), so memory does not grow with the window's length."""
    if streams_whole_windows(loader.dataset):
        yield from streamed_predictions(model, loader, device_inputs, runtime, infer_cfg, bad_inputs)
        return
    for batch in GuardedBatches(loader, bad_inputs):
        if bad_inputs is not None:
            bad_inputs.take(batch)
        annotated_frames = "frame_labels" in batch and bool((batch["frame_labels"] >= 0).any())
        with runtime.autocast():
            out = forward_chunked(
                model,
                device_inputs(batch),
                infer_cfg.chunk_size,
                infer_cfg.chunk_overlap,
                infer_cfg.chunk_aggregation,
                infer_cfg.chunks_per_forward,
                frame_stride,
            )
        yield batch, out.logits.float().cpu(), out if annotated_frames else None


def streams_whole_windows(dataset) -> bool:
    """Are the dataset's evaluation clips whole sample windows of decoded frames (streamed, not loaded)?"""
    return (
        isinstance(dataset, VideoWindowDataset)
        and not dataset.training
        and dataset.cfg.num_frames == -1
        and dataset.cfg.load_rgb
    )


def streamed_predictions(
    model,
    loader: DataLoader,
    device_inputs: DeviceInputs,
    runtime: Runtime,
    infer_cfg: InferConfig,
    bad_inputs: BadInputReport | None,
):
    """``clip_predictions`` of whole sample windows, one sample at a time: its window's inference chunks decoded
    a few ahead of the model (``ChunkStream``), through ``run_stream`` as infer_chunked.py runs them (chunk
    features or logits on the host, a temporal head once at the end). The same samples, labels and chunks as
    the loader's; a file that cannot be read is skipped or raised as data.on_bad_video says."""
    dataset = loader.dataset
    spec = InferenceSpec.of_config(infer_cfg)
    for index in loader.sampler:
        window = dataset.windows[index // dataset.samples_per_window]
        record = dataset.records[window.record]
        try:
            stream = ChunkStream(
                record, dataset.cfg, spec, window=(window.start, window.end), crop=index % dataset.crops
            )
            try:
                out, _ = run_stream(model, stream, device_inputs, runtime, spec.aggregation)
            finally:
                stream.close()
        except BAD_INPUT_ERRORS as e:
            if dataset.cfg.on_bad_video == "raise":
                raise type(e)(f"{e} (sample at {record.where})") from None
            skipped = {"skipped": {record.first_path: f"{e} (sample at {record.where})"}}
            if bad_inputs is not None:
                bad_inputs.take(skipped)
            else:
                log.warning("skipping %s", skipped["skipped"][record.first_path])
            continue
        indices = stream.video_frame(np.arange(len(range(0, stream.num_frames, stream.stride))))
        labels = torch.from_numpy(frame_labels(window.segments, indices, window.label))[None]
        batch: Sample = {  # collated: a batch of one
            "label": torch.tensor([window.label]),
            "video_index": torch.tensor([window.record]),
            "window": torch.tensor([[window.start, window.end]]),
            "frame_labels": labels,
        }
        yield batch, out.logits.float().cpu(), out if bool((labels >= 0).any()) else None


def score_clip_timelines(scores: SegmentationScores, chunked: ChunkedOutput, frame_labels: torch.Tensor) -> None:
    """Each clip's per-frame labels (its chunks' probabilities blended, engine.inference.timeline) scored against its
    frame labels, on the frames a segment covers."""
    windows = np.array(chunked.windows).reshape(-1, 2)
    probs = chunked.chunk_logits.float().softmax(dim=-1).numpy()  # [n, B, K]
    for b, truth in enumerate(frame_labels.numpy()):
        if (truth >= 0).any():
            predicted = frame_probabilities(probs[:, b], windows, len(truth)).argmax(axis=1)
            scores.add(*annotated(predicted, truth))


class DatasetEvaluation(NamedTuple):
    metrics: dict  # the split's metrics (core.metric_names)
    clip_rows: list  # eval.py's row a clip: its video, window, label, prediction and probability
    video_rows: list  # eval.py's row a video (per_video_rows)


def evaluate_dataset(model, dataset, cfg: Config, runtime, class_names: list[str]) -> DatasetEvaluation:
    """The evaluation loop of training's validation (``evaluate``) with the rows eval.py writes.
    The test clips x crops of one sample window (data.test_clips x data.test_crops, all of one length) go through
    the model together, ``infer.chunks_per_forward`` chunks a forward call; predictions go to the CPU as they are
    made."""
    loader = make_loader(
        dataset, cfg.data, cfg.train.seed, runtime, dataset.samples_per_window, shuffle=False, pad=False
    )
    device_inputs = DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std)
    meter, clip_rows, bad_inputs = ClassificationMeter(len(class_names)), [], BadInputReport(dataset)

    def add_clip_rows(batch, logits):
        for p, label, video, window in zip(
            logits.softmax(dim=1), batch["label"], batch["video_index"], batch["window"]
        ):
            clip_rows.append(
                {
                    "video": _video_name(dataset, int(video)),
                    "window_start": int(window[0]),
                    "window_end": int(window[1]),
                    "label": class_names[int(label)],
                    "predicted": class_names[int(p.argmax())],
                    "probability": round(float(p.max()), 6),
                }
            )

    metrics = evaluate(
        model,
        loader,
        device_inputs,
        runtime,
        cfg.infer,
        len(class_names),
        bad_inputs,
        meter,
        add_clip_rows,
        frame_stride=cfg.data.frame_stride,
        background=background_indices(cfg.data.background_labels, class_names),
    )
    bad_inputs.end_run()
    return DatasetEvaluation(
        metrics, clip_rows, per_video_rows(meter, class_names, lambda index: _video_name(dataset, index))
    )


def per_video_rows(meter: ClassificationMeter, class_names: list[str], name_of) -> list[dict]:
    """eval.py's row a video: its name (``name_of(video index)``), label, prediction, probability, clips."""
    return [
        {
            "video": name_of(v["video_index"]),
            "label": class_names[v["label"]],
            "predicted": class_names[v["predicted"]],
            "probability": round(v["probability"], 6),
            "clips": v["clips"],
        }
        for v in meter.video_predictions()
    ]


def _video_name(dataset, video_index: int) -> str:
    return ";".join(dataset.records[video_index].views.values())


def format_report(metrics: dict, class_names: list[str]) -> str:
    top5 = f"top-5 {metrics['top5']:.4f}" if len(class_names) > 5 else "top-5 n/a (5 classes or fewer)"
    lines = [
        f"top-1 clip acc {metrics['clip_acc']:.4f}  {top5}  "
        f"video-level acc {metrics.get('video_acc', float('nan')):.4f} (mean over classes "
        f"{metrics.get('video_mean_class_acc', float('nan')):.4f})  mean class acc "
        f"{metrics['mean_class_acc']:.4f}  ({metrics['num_clips']} clips, {metrics.get('num_videos', 0)} videos)",
        f"{'class':>16s} {'precision':>9s} {'recall':>9s} {'f1':>9s}",
    ]
    for i, name in enumerate(class_names):
        lines.append(f"{name:>16s} {metrics['precision'][i]:9.4f} {metrics['recall'][i]:9.4f} {metrics['f1'][i]:9.4f}")
    if "seg_edit" in metrics:
        scores = {k[4:]: v for k, v in metrics.items() if k.startswith("seg_")}
        lines.append(f"timelines ({metrics['seg_clips']} clips with segments): {format_scores(scores)}")
    width = max(6, max(len(n) for n in class_names))
    lines.append("confusion matrix (rows: true, columns: predicted)")
    lines.append(" " * (width + 1) + " ".join(f"{n[:width]:>{width}s}" for n in class_names))
    for name, row in zip(class_names, metrics["confusion"]):
        lines.append(f"{name[:width]:>{width}s} " + " ".join(f"{v:>{width}d}" for v in row))
    return "\n".join(lines)


def write_outputs(prefix: str, metrics: dict, clip_rows: list[dict], video_rows: list[dict], info: dict) -> None:
    atomic_write_bytes(prefix + ".json", json.dumps({**info, "metrics": metrics}, indent=1).encode())
    for path, rows in ((prefix + ".csv", video_rows), (prefix + "_clips.csv", clip_rows)):
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["video"])
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(path, text.getvalue().encode())


@dataclass
class EvaluationResult:
    """One checkpoint evaluated: its metrics, the config used, its class names and summary, the rows."""

    metrics: dict
    cfg: Config
    class_names: list
    checkpoint: CheckpointSummary
    clip_rows: list
    video_rows: list
    head_reach: str = ""  # how a temporal head saw each video ("spans of 38 chunks, ...")


def evaluate_on_features(
    path: str, model, cfg: Config, class_names, checkpoint, precision: str | None, spec
) -> EvaluationResult:
    """A head trained on MS-TCN's layout scored on its split's test videos, whole, one a batch: the validation of
    its training run, with a row per video. ``spec``: eval.py's (none of its data and chunk flags apply)."""
    if spec.data is not None or spec.overrides or spec.batch_auto:
        raise UsageError(
            f"{path}: a head trained on the features of an MS-TCN dataset is scored on the test bundle of the split "
            f"it trained on (data.features_split {cfg.data.features_split}), whole videos: --data, --chunk, "
            f"--overlap, --agg and --batch do not apply; leave them out"
        )
    dataset = test_videos(cfg.data)
    runtime = setup_runtime(cfg.trainer, device=str(next(model.parameters()).device), precision=precision)
    loader = feature_loader(dataset, cfg.train.seed, runtime, 1, shuffle=False, pad=False)
    meter = ClassificationMeter(len(class_names))
    background = background_indices(cfg.data.background_labels, class_names)
    device_inputs = DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std)
    metrics = evaluate(
        model, loader, device_inputs, runtime, cfg.infer, len(class_names), meter=meter, background=background
    )
    rows = per_video_rows(meter, class_names, lambda index: dataset.names[index])
    return EvaluationResult(metrics, cfg, class_names, checkpoint, [], rows, "whole videos")
