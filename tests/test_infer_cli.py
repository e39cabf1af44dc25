"""infer_chunked.py's input and flags: the frames that exist, the manifest lines train and eval refuse, flag and
checkpoint errors in one line (infer_chunked.py, datasets/records.py)."""

import json
import os

from conftest import error_lines, run_in_process, run_python, write_with_opencv

from artifacts.checkpoint import load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_infer_counts_only_the_frames_that_exist(trained_run, tmp_path):
    import cv2

    cut = write_with_opencv(str(tmp_path / "cut.avi"), 200, "MJPG")
    content = open(cut, "rb").read()
    open(cut, "wb").write(content[: len(content) // 2])
    capture, decoded = cv2.VideoCapture(cut), 0
    while capture.grab():
        decoded += 1
    real = decoded - 1  # the frame the cut halves: decoders conceal its missing half, the index does not count it
    assert 10 < real < 200
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    result = run_python(
        [
            "infer_chunked.py",
            "--checkpoint",
            best,
            "--input",
            cut,
            "--chunk",
            "12",
            "--overlap",
            "0",
            "--output",
            str(tmp_path / "out.jsonl"),
        ]
    )
    assert result.returncode == 0, result.stderr
    [line] = [json.loads(t) for t in (tmp_path / "out.jsonl").read_text().splitlines()]
    stride = load_checkpoint(best).config["data"]["frame_stride"]
    clip_frames = len(range(0, real, stride))
    assert line["num_frames"] == real and line["chunks"] == -(-clip_frames // 12)  # no chunk past the real end
    assert f"{cut}: {real} frames" in result.stdout  # the console summary as well


def test_infer_refuses_the_manifest_lines_that_train_and_eval_refuse(trained_run, synthetic_root, tmp_path):
    long = json.loads(open(os.path.join(synthetic_root, "long.jsonl")).readline())
    video = os.path.join(synthetic_root, long["video"])
    lines = [
        {
            "video": video,
            "segments": [{"start": 0, "end": 100, "label": "up"}, {"start": 5000, "end": 5100, "label": "up"}],
        },  # past the end
        {"video": video, "label": "zebra"},  # not a class of the model
        {"video": video, "label": "up"},
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    result = run_python(
        [
            "infer_chunked.py",
            "--checkpoint",
            best,
            "--input",
            str(tmp_path / "m.jsonl"),
            "--chunk",
            "8",
            "--overlap",
            "0",
        ]
    )
    assert result.returncode == 1
    errors = error_lines(result.stderr)
    assert errors == [
        f"error: {tmp_path / 'm.jsonl'}:1: segment [5000, 5100) 'up' starts after the video's 300 frames",
        f"error: {tmp_path / 'm.jsonl'}:2: label 'zebra' is not a known class (down, grow, left, right, shrink, up)",
    ]
    assert "(true: up)" in result.stdout  # the good line ran


def test_infer_flag_and_checkpoint_choice_errors(trained_run, tmp_path):
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    result = run_in_process(["infer_chunked.py", "--checkpoint", best, "--batch", "many"])
    assert (result.returncode, result.stderr) == (2, "error: --batch many: expected a number of chunks, or auto\n")
    result = run_in_process(["infer_chunked.py", "--checkpoint", best, "--topk", "0"])
    assert (result.returncode, result.stderr) == (2, "error: --topk 0: must be >= 1\n")
    (tmp_path / "p.yaml").write_text(
        f"base: {os.path.join(ROOT, 'configs', 'base.yaml')}\nexperiment: nothing\ntrainer:\n  output_dir: {tmp_path}\n"
    )
    result = run_in_process(["infer_chunked.py", "--config", str(tmp_path / "p.yaml")])
    assert (result.returncode, result.stderr) == (
        2,
        f"error: --config {tmp_path / 'p.yaml'}: no {tmp_path}/nothing/latest/checkpoints/best.pt (experiment "
        f"'nothing' has no trained run here); train it first or pass --checkpoint PATH\n",
    )
    result = run_in_process(
        [
            "infer_chunked.py",
            "--checkpoint",
            best,
            "--chunk",
            "16",
            "--batch",
            "auto",
            "--memory-budget-gb",
            "0.000001",
            "--device",
            "cpu",
        ]
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: --batch auto: even 1 chunk of 16 frames does not fit the ")
    assert result.stderr.endswith("; use a shorter --chunk\n")


def test_a_video_result_line_holds_the_set_fields_and_never_the_arrays():
    import numpy as np

    from engine.inference.video_result import ChunkFeatures, FrameTimeline, VideoResult

    result = VideoResult(
        "a.mp4",
        100,
        25.0,
        4,
        [{"label": "up", "prob": 0.9}, {"label": "down", "prob": 0.1}],
        0.5,
        0.25,
        label="down",
        scores={"frame_acc": 0.5},
        frames=FrameTimeline(np.zeros(100, dtype=np.int64), np.ones(100), None),
        features=ChunkFeatures(np.zeros((4, 8)), np.zeros((4, 2)), np.zeros((4, 2)), 2),
    )
    line = result.to_json()
    assert list(line) == [
        "video",
        "num_frames",
        "fps",
        "chunks",
        "topk",
        "decode_s",
        "compute_s",
        "label",
        "correct",
        "scores",
    ]
    assert line["correct"] is False and json.loads(json.dumps(line)) == line
    assert VideoResult("b.mp4", error="b.mp4: cannot be read").to_json() == {
        "video": "b.mp4",
        "error": "b.mp4: cannot be read",
    }
    assert VideoResult("c.mp4", topk=[{"label": "up", "prob": 1.0}]).correct is None  # no label: neither
