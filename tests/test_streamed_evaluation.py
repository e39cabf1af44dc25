"""Evaluation of whole sample windows (data.num_frames -1: a head on features paired with its backbone, eval.py
--num-frames -1) streams each window from its file, as infer_chunked.py streams a video: the results of the
loader's whole-clip path, without the whole clip in memory."""

import logging
import os

import pytest
import torch

from config import load_config
from core.runtime import Runtime
from datasets.bad_input import BadInputReport
from datasets.device_input import DeviceInputs
from datasets.segmentation_task import SEGMENT_CLASSES, generate_segmentation
from datasets.video.info import VideoReadError
from datasets.video_dataset import build_dataset
from engine.data.loaders import make_loader
from engine.evaluation import evaluate as evaluation
from engine.metrics.segments import background_indices
from models import build_model


@pytest.fixture(scope="module")
def segments_root(tmp_path_factory):
    return generate_segmentation(
        str(tmp_path_factory.mktemp("streamed")),
        seed=1,
        num_train=2,
        num_val=3,
        frames=150,
        shortest=20,
        longest=50,
        quiet=True,
    )


def whole_window_cfg(root, *extra):
    return load_config(
        None,
        [
            f"data.data_dir={root}",
            "data.train_manifest=seg_train.jsonl",
            "data.val_manifest=seg_val.jsonl",
            "data.class_names=null",
            "data.num_frames=-1",
            "data.frame_stride=2",
            "data.img_size=24",
            "data.num_workers=0",
            "data.sample_timeout_s=null",
            "model.width=4",
            "infer.chunk_size=8",
            "infer.chunk_overlap=2",
            "infer.chunks_per_forward=3",
            "trainer.device=cpu",
            *extra,
        ],
    )


def evaluated(cfg, streamed: bool, monkeypatch, dataset=None):
    """(metrics, each clip's (video, window, logits)) of the val split, streamed or through the loader."""
    with monkeypatch.context() as patch:
        if not streamed:
            patch.setattr(evaluation, "streams_whole_windows", lambda dataset: False)
        dataset = dataset or build_dataset(cfg, "val", list(SEGMENT_CLASSES), training=False)
        assert evaluation.streams_whole_windows(dataset) == streamed
        torch.manual_seed(0)
        model = build_model(cfg.model, num_classes=len(dataset.class_names)).eval()
        runtime = Runtime(torch.device("cpu"), "32")
        loader = make_loader(dataset, cfg.data, 0, runtime, dataset.samples_per_window, shuffle=False, pad=False)
        clips = []
        metrics = evaluation.evaluate(
            model,
            loader,
            DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std),
            runtime,
            cfg.infer,
            len(dataset.class_names),
            BadInputReport(dataset),
            on_clips=lambda batch, logits: clips.extend(
                zip(batch["video_index"].tolist(), batch["window"].tolist(), logits)
            ),
            frame_stride=cfg.data.frame_stride,
            background=background_indices(cfg.data.background_labels, dataset.class_names),
        )
    return metrics, clips


@pytest.mark.parametrize(
    "settings",
    [
        ["model.temporal_head=transformer"],  # the head once over every chunk of the window
        ["model.temporal_head=tcn", "data.max_video_frames=60", "data.test_crops=3"],  # sample windows, 3 crops each
        ["model.temporal_head=none", "infer.chunk_aggregation=prob"],  # chunk logits aggregated as they come
    ],
    ids=["transformer", "tcn-windows-crops", "no-head"],
)
def test_streamed_whole_windows_give_the_loaders_results(segments_root, monkeypatch, settings):
    cfg = whole_window_cfg(segments_root, *settings)
    streamed, streamed_clips = evaluated(cfg, True, monkeypatch)
    loaded, loaded_clips = evaluated(cfg, False, monkeypatch)
    assert streamed["num_clips"] == loaded["num_clips"] == len(streamed_clips) >= 3
    assert "seg_edit" in streamed and streamed["seg_clips"] == loaded["seg_clips"]
    for key in ("clip_acc", "video_acc", "seg_frame_acc", "seg_edit", "seg_f1@10", "seg_f1@50"):
        assert streamed[key] == pytest.approx(loaded[key], abs=1e-9), key
    for (video, window, logits), (video_b, window_b, logits_b) in zip(streamed_clips, loaded_clips):
        assert (video, window) == (video_b, window_b)
        torch.testing.assert_close(logits, logits_b, atol=1e-5, rtol=1e-5)


def test_a_file_that_fails_while_streamed_is_skipped_or_named_as_data_on_bad_video_says(
    segments_root, tmp_path, monkeypatch, caplog
):
    cfg = whole_window_cfg(segments_root, "model.temporal_head=tcn", "data.on_bad_video=skip")
    raising = whole_window_cfg(segments_root, "model.temporal_head=tcn", "data.on_bad_video=raise")
    skipping_set, raising_set = (build_dataset(c, "val", list(SEGMENT_CLASSES), training=False) for c in (cfg, raising))
    gone = skipping_set.records[1].first_path
    moved = str(tmp_path / "elsewhere.mp4")
    os.rename(gone, moved)  # indexed, then gone before it is evaluated
    try:
        with caplog.at_level(logging.WARNING, logger="longvideo"):
            metrics, clips = evaluated(cfg, True, monkeypatch, skipping_set)
        assert metrics["num_videos"] == 2 and {video for video, _, _ in clips} == {0, 2}
        assert any(gone in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)
        with pytest.raises(VideoReadError, match=f"{os.path.basename(gone)}.*sample at"):
            evaluated(raising, True, monkeypatch, raising_set)
    finally:
        os.rename(moved, gone)
