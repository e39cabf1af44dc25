"""A short training run on the synthetic data, then eval.py and infer_chunked.py on its checkpoints."""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import overrides, run_in_process

import train
from artifacts.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_training_writes_the_run_directory(trained_run):
    run_dir, _ = trained_run
    names = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert names == ["best.pt", "epoch_0001.pt", "epoch_0002.pt", "last.pt"]
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    videos, accuracy = int(rows[-1]["val_num_videos"]), float(rows[-1]["val_video_acc"])
    assert videos > 0 and round(accuracy * videos) == pytest.approx(accuracy * videos, abs=1e-3)  # k of n videos
    assert os.path.exists(os.path.join(run_dir, "config.yaml"))
    with open(os.path.join(run_dir, "memory.csv")) as f:
        assert {"1", "2"} <= {row["epoch"] for row in csv.DictReader(f)}  # at least a row each epoch
    ckpt = load_checkpoint(os.path.join(run_dir, "checkpoints", "last.pt"))
    assert ckpt.state.epoch == 2 and ckpt.state.global_step == 10  # 18 clips / batch 4 = 5 steps an epoch
    assert ckpt.class_names == ["down", "grow", "left", "right", "shrink", "up"]
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt.model)
    assert None not in (ckpt.optimizer, ckpt.scheduler, ckpt.scaler, ckpt.rng) and ckpt.config


def test_resume_continues_exactly(trained_run, synthetic_root, tmp_path):
    run_dir, _ = trained_run
    reference = load_checkpoint(os.path.join(run_dir, "checkpoints", "last.pt"))
    args = overrides(synthetic_root, tmp_path, "infer.chunk_size=4", "infer.chunk_overlap=1")
    assert train.main(args + ["--stop-after-steps", "3"]) == 0  # stopped in the middle of epoch 1
    assert train.main(args + ["--resume", "auto"]) == 0
    resumed = load_checkpoint(os.path.join(tmp_path, "e2e", "latest", "checkpoints", "last.pt"))
    assert resumed.state.global_step == reference.state.global_step
    for key, value in reference.model.items():
        torch.testing.assert_close(resumed.model[key], value, rtol=0, atol=0, msg=key)
    assert resumed.state.history[-1]["val_video_acc"] == reference.state.history[-1]["val_video_acc"]


def test_resume_auto_without_a_checkpoint_is_an_error(synthetic_root, tmp_path):
    result = run_in_process(
        ["train.py", *overrides(synthetic_root, tmp_path), "--resume", "auto"],
    )
    assert result.returncode == 2
    assert result.stderr.strip().endswith("start without --resume, or give a checkpoint path")
    assert "no " in result.stderr and "last.pt to continue from" in result.stderr


def test_eval_reports_and_writes_metrics_and_predictions(trained_run, tmp_path):
    run_dir, _ = trained_run
    best = os.path.join(run_dir, "checkpoints", "best.pt")
    result = run_in_process(
        [
            "eval.py",
            "--checkpoint",
            best,
            "--split",
            "val",
            "--chunk",
            "4",
            "--overlap",
            "1",
            "--agg",
            "prob",
            "--output",
            str(tmp_path / "ev"),
        ],
    )
    assert result.returncode == 0, result.stderr
    assert "confusion matrix" in result.stdout and "video-level acc" in result.stdout
    metrics = json.load(open(tmp_path / "ev.json"))["metrics"]
    clips = list(csv.DictReader(open(tmp_path / "ev_clips.csv")))
    assert len(clips) == metrics["num_clips"] == 6
    assert metrics["clip_acc"] == pytest.approx(sum(r["label"] == r["predicted"] for r in clips) / len(clips))
    videos = list(csv.DictReader(open(tmp_path / "ev.csv")))
    assert len(videos) == metrics["num_videos"] == 6 and all(v["clips"] == "1" for v in videos)
    assert metrics["video_acc"] == pytest.approx(sum(v["label"] == v["predicted"] for v in videos) / len(videos))
    three = run_in_process(
        [
            "eval.py",
            "--checkpoint",
            best,
            "--split",
            "val",
            "--crops",
            "3",
            "--output",
            str(tmp_path / "three"),
        ],
    )
    assert three.returncode == 0, three.stderr
    assert json.load(open(tmp_path / "three.json"))["metrics"]["num_clips"] == 18  # 3 spatial crops of each clip
    assert all(v["clips"] == "3" for v in csv.DictReader(open(tmp_path / "three.csv")))
    bad = run_in_process(
        ["eval.py", "--checkpoint", best, "--chunk", "4", "--overlap", "4"],
    )
    assert bad.returncode == 2
    assert bad.stderr == (
        "error: --overlap: infer.chunk_overlap=4 must be smaller than infer.chunk_size=4 "
        "(or set chunk_size: -1 for no chunking)\n"
    )


def test_infer_chunked_streams_a_long_video_with_a_timeline(trained_run, synthetic_root, tmp_path):
    _, out = trained_run
    output = tmp_path / "out.jsonl"
    result = run_in_process(
        [
            "infer_chunked.py",
            "--runs",
            str(out),
            "--input",
            os.path.join(synthetic_root, "long.jsonl"),
            "--chunk",
            "8",
            "--overlap",
            "2",
            "--timeline",
            "--output",
            str(output),
        ],
    )
    assert result.returncode == 0, result.stderr
    assert "best.pt" in result.stdout.splitlines()[0]  # the most recent run's best checkpoint was chosen
    line = json.loads(output.read_text().splitlines()[0])
    assert line["num_frames"] == 300 and line["fps"] == 25.0
    # 300 frames at stride 2 = 150 clip frames; chunks of 8 with overlap 2: 1 + ceil((150 - 8) / 6) = 25
    assert line["chunks"] == len(line["chunk_results"]) == 25
    assert line["chunk_results"][0]["start"] == 0 and line["chunk_results"][-1]["end"] == 299
    assert line["segments"][0]["start"] == 0 and line["segments"][-1]["end"] == 300
    assert all(a["end"] == b["start"] for a, b in zip(line["segments"], line["segments"][1:]))
    # the frame accuracy is the share of annotated frames whose segment has their label, counted here again
    truth = json.loads(open(os.path.join(synthetic_root, "long.jsonl")).readline())["segments"]
    predicted = {frame: seg["label"] for seg in line["segments"] for frame in range(seg["start"], seg["end"])}
    annotated = [(frame, seg["label"]) for seg in truth for frame in range(seg["start"], min(seg["end"], 300))]
    hits = sum(predicted.get(frame) == label for frame, label in annotated)
    assert line["scores"]["frame_acc"] == pytest.approx(hits / len(annotated))
    assert set(line["scores"]) == {"frame_acc", "edit", "f1@10", "f1@25", "f1@50"}
    # every frame's row in the CSV, with the label of its segment; the split's scores in the JSON beside it
    with open(tmp_path / "out_frames.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["video"] == line["video"]]
    assert [int(row["frame"]) for row in rows] == list(range(300))
    assert all(row["label"] == predicted[int(row["frame"])] for row in rows)
    assert [row["true_label"] for row in rows[: len(annotated)]] == [label for _, label in annotated]
    scores = json.loads((tmp_path / "out_scores.json").read_text())
    assert scores["videos"] == len(output.read_text().splitlines())
    assert "timelines over" in result.stdout and "F1@50" in result.stdout


def test_infer_chunked_bad_inputs(trained_run, tmp_path):
    run_dir, _ = trained_run
    best = os.path.join(run_dir, "checkpoints", "best.pt")

    def run(*args):
        return subprocess.run(
            [sys.executable, "infer_chunked.py", "--checkpoint", best, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    result = run("--input", str(tmp_path / "nope.mp4"))
    assert (result.returncode, result.stderr) == (2, f"error: --input {tmp_path / 'nope.mp4'}: file not found\n")
    result = run("--chunk", "8", "--overlap", "8")  # checked by config.py, over the checkpoint config's defaults
    assert (result.returncode, result.stderr) == (
        2,
        "error: --overlap: infer.chunk_overlap=8 must be smaller than "
        "infer.chunk_size=8 (or set chunk_size: -1 for no "
        "chunking)\n",
    )
    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "a_broken.mp4").write_bytes(b"not a video" * 100)
    from conftest import write_with_opencv

    write_with_opencv(str(tmp_path / "videos" / "b_good.avi"), 30, "MJPG")
    result = run(
        "--input", str(tmp_path / "videos"), "--chunk", "4", "--overlap", "0", "--output", str(tmp_path / "o.jsonl")
    )
    lines = [json.loads(t) for t in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert result.returncode == 1  # one input failed, the other ran
    assert "OpenCV cannot open this file" in lines[0]["error"] and lines[1]["num_frames"] == 30


def test_a_checkpoint_from_an_incompatible_config_is_a_clear_error(trained_run, tmp_path):

    run_dir, _ = trained_run
    ckpt = load_checkpoint(os.path.join(run_dir, "checkpoints", "best.pt"))
    ckpt.config["model"]["backbone"] = "r3d_18"
    save_checkpoint(ckpt, str(tmp_path / "other.pt"))
    result = run_in_process(
        [
            "infer_chunked.py",
            "--checkpoint",
            str(tmp_path / "other.pt"),
            "--chunk",
            "4",
            "--overlap",
            "0",
        ],
    )
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"error: {tmp_path / 'other.pt'}: weights do not match model.backbone=r3d_18: ")


def test_a_checkpoint_with_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    import argparse

    torch.save({"model": {}, "payload": argparse.Namespace(run="code")}, path)  # not a tensor or plain value
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(path))
    assert str(info.value).startswith(f"{path}: refused: the file needs pickled code to load")


def test_a_torn_checkpoint_is_a_clear_error(trained_run, tmp_path):
    run_dir, _ = trained_run
    data = open(os.path.join(run_dir, "checkpoints", "last.pt"), "rb").read()
    (tmp_path / "torn.pt").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=r"torn\.pt: not a readable checkpoint \(truncated or corrupt\?\)"):
        load_checkpoint(str(tmp_path / "torn.pt"))


def test_plots_are_drawn_once_at_the_end_or_one_note_without_matplotlib(trained_run, monkeypatch, capsys):
    from artifacts import plots
    from artifacts.run_dir import RunDirectory

    run_dir, _ = trained_run
    try:
        import matplotlib  # noqa: F401

        assert sorted(n for n in os.listdir(run_dir) if n.endswith(".png")) == [
            "confusion_matrix.png",
            "training_curves.png",
        ]
    except ImportError:
        assert not [n for n in os.listdir(run_dir) if n.endswith(".png")]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert plots.training_plots(RunDirectory(run_dir), ["a"], [[1]]) == []
    assert capsys.readouterr().out == (
        "note: plotting the training curves needs matplotlib (pip install matplotlib); no plots written\n"
    )


def test_a_checkpoint_from_before_the_infer_section_evaluates_as_it_did(trained_run, tmp_path):
    """A checkpoint whose saved config has the seed guides' layout (the inference chunk under train) evaluates
    with those settings, as one saved with the infer section does, and says nothing about the old names."""
    run_dir, _ = trained_run
    ckpt = load_checkpoint(os.path.join(run_dir, "checkpoints", "best.pt"))
    config = ckpt.config
    infer = config.pop("infer")
    assert (infer["chunk_size"], infer["chunk_overlap"]) == (4, 1)
    config["train"].update(
        chunk_infer_size=4,
        chunk_overlap=1,
        chunk_aggregation=infer["chunk_aggregation"],
        video_batch_size=infer["chunks_per_forward"],
    )
    config["model"]["temporal_window"] = infer["head_chunks"]
    old = str(tmp_path / "old.pt")
    save_checkpoint(ckpt, old)

    def run(path):
        result = run_in_process(["eval.py", "--checkpoint", path])
        assert result.returncode == 0, result.stderr
        return result.stdout.split("\n", 1)[1], result.stdout.split("\n", 1)[0], result.stderr

    report, first_line, stderr = run(old)
    assert "chunk 4 overlap 1" in first_line and "is now called" not in stderr
    assert report == run(os.path.join(run_dir, "checkpoints", "best.pt"))[0]
