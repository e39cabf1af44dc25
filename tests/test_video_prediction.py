"""A video's prediction, one definition (docs/inference.md): its frames at data.frame_stride through the model in
inference chunks, aggregated (or the temporal head over them all). infer_chunked.py gives it for each video;
eval.py --whole-videos gives the same for every video, with and without a temporal head, where the checkpoint's
config splits videos into sample windows (which eval.py's default, like training's validation, scores by their
clips)."""

import csv
import json
import os

import pytest
from conftest import overrides, run_in_process

import train

MODELS = {
    "no head": ["infer.chunk_size=4", "infer.chunk_overlap=1"],
    "transformer head": ["model.temporal_head=transformer", "train.chunk_train_size=4", "train.chunk_train_overlap=1"],
}


@pytest.fixture(scope="module", params=list(MODELS))
def windowed_run(request, synthetic_root, tmp_path_factory):
    """A model trained on sample windows of 12 frames (the 20-frame clips give two each)."""
    out = tmp_path_factory.mktemp("windowed")
    extra = ["data.max_video_frames=12", "data.num_frames=6", "train.max_epochs=1", *MODELS[request.param]]
    assert train.main(overrides(synthetic_root, out, *extra)) == 0
    return os.path.join(out, "e2e", "latest", "checkpoints", "best.pt")


def test_eval_whole_videos_gives_infer_chunked_s_prediction_for_every_video(windowed_run, synthetic_root, tmp_path):
    manifest = os.path.join(synthetic_root, "val.jsonl")
    evaluated = run_in_process(
        ["eval.py", "--checkpoint", windowed_run, "--data", manifest, "--whole-videos", "--output", str(tmp_path / "e")]
    )
    assert evaluated.returncode == 0, evaluated.stderr
    inferred = run_in_process(
        ["infer_chunked.py", "--checkpoint", windowed_run, "--input", manifest, "--output", str(tmp_path / "i.jsonl")]
    )
    assert inferred.returncode == 0, inferred.stderr
    by_eval = {row["video"]: row for row in csv.DictReader(open(tmp_path / "e.csv"))}
    by_infer = [json.loads(line) for line in open(tmp_path / "i.jsonl")]
    assert len(by_infer) == len(by_eval) == 6
    for line in by_infer:
        row = by_eval[line["video"]]
        assert row["clips"] == "1"  # the whole video, one sample
        assert row["predicted"] == line["topk"][0]["label"], line["video"]
        assert float(row["probability"]) == pytest.approx(line["topk"][0]["prob"], abs=1e-4), line["video"]
    windows = run_in_process(
        ["eval.py", "--checkpoint", windowed_run, "--data", manifest, "--output", str(tmp_path / "w")]
    )
    assert windows.returncode == 0, windows.stderr
    assert {row["clips"] for row in csv.DictReader(open(tmp_path / "w.csv"))} == {"2"}  # by default: its windows


def test_whole_videos_leaves_no_clip_flag_to_contradict_it(windowed_run):
    result = run_in_process(["eval.py", "--checkpoint", windowed_run, "--whole-videos", "--clips", "3"])
    assert result.returncode == 2
    assert "--whole-videos streams each video whole: leave out --num-frames, --clips and --crops" in result.stderr
