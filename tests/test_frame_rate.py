"""data.fps: clips and inference chunks sampled by time, not by frames. A 25 fps and a 50 fps recording give clips of
the same span of seconds, each stride read from its file."""

import json
import os

import numpy as np
import pytest
from conftest import BASE_CONFIG, write_with_pyav

from config import ConfigError, load_config
from datasets.chunk_stream import ChunkStream
from datasets.manifest import VideoRecord
from datasets.records import training_records
from datasets.video_dataset import VideoWindowDataset
from datasets.windows import video_stride
from engine.inference.stream import InferenceSpec


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    """The same 4 seconds at 25 and at 50 frames a second."""
    folder = tmp_path_factory.mktemp("rates")
    paths = {fps: write_with_pyav(str(folder / f"at_{fps}.mp4"), 4 * fps, "libx264", fps=fps) for fps in (25, 50)}
    manifest = folder / "videos.jsonl"
    manifest.write_text("".join(json.dumps({"video": p, "label": "a"}) + "\n" for p in paths.values()))
    return paths, str(manifest)


def test_each_video_s_stride_is_its_rate_over_data_fps():
    assert video_stride(3, None, 60.0) == 3  # no data.fps: data.frame_stride
    assert [video_stride(3, 12.5, rate) for rate in (25.0, 29.97, 50.0, 60.0, 10.0)] == [2, 2, 4, 5, 1]


def test_clips_of_a_25_and_a_50_fps_recording_cover_the_same_seconds(recordings):
    paths, manifest = recordings
    changes = [f"data.train_manifest={manifest}", "data.val_manifest=null", "data.fps=12.5", "data.num_frames=8"]
    changes.append("data.img_size=32")
    cfg = load_config(BASE_CONFIG, changes)
    records, _ = training_records(cfg.data)
    dataset = VideoWindowDataset(records, ["a"], cfg.data, training=False)
    spans = {}
    for index in range(len(dataset)):
        sample = dataset[index]
        indices = sample["frame_indices"].numpy()
        fps = 25 if "at_25" in dataset.path_of(index) else 50
        assert np.all(np.diff(indices) == fps // 12.5)  # 2 and 4 video frames apart
        spans[fps] = (indices[-1] - indices[0]) / fps
    assert spans[25] == spans[50] == pytest.approx(7 / 12.5)
    streams = {}
    for fps, path in paths.items():
        stream = ChunkStream(VideoRecord({"video": path}), cfg.data, InferenceSpec(chunk=8, overlap=0))
        try:
            streams[fps] = (stream.stride, len(stream.windows))
        finally:
            stream.close()
    assert streams == {25: (2, 7), 50: (4, 7)}  # 50 and 100 frames at their strides: the same chunks of seconds


def test_data_fps_must_be_a_rate():
    with pytest.raises(ConfigError, match="data.fps must be"):
        load_config(BASE_CONFIG, ["data.fps=0"])
    assert os.path.exists(BASE_CONFIG)
