"""docs/timelines.md's two-stage path, its commands run as written in a fresh workspace: a backbone trained per
chunk, its features, a temporal head trained on them, the pair run on whole videos; with what its runs must show."""

import csv
import json
import os

import pytest
from conftest import error_lines, run_in_process
from doc_commands import bash_blocks, fresh_workspace, run

from artifacts.checkpoint import load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def two_stage(tmp_path_factory):
    """docs/timelines.md's two-stage commands, run as written in a fresh workspace (doc_commands.py): the timeline
    task (12 training, 6 validation videos of 240 frames), a backbone trained per chunk (configs/timelines.yaml), its
    features, a tcn head trained on them (configs/timelines-head.yaml), the pair run on the validation videos."""
    folder = fresh_workspace(tmp_path_factory)
    commands = bash_blocks("docs/timelines.md", "## Two stages: features, then a temporal model over whole videos")
    assert len(commands) == 7
    results = []
    for command in commands:
        results.append(run(command, folder))
        assert results[-1].returncode == 0, (command, results[-1].stderr[-2000:])
    runs, data = folder / "runs", str(folder / "data" / "segmentation")
    head_run = ["--set", f"data.data_dir={data}", "--set", f"data.features_dir={data}/features"]
    return {
        "data": data,
        "runs": runs,
        "folder": folder,
        "results": results,
        "head_run": head_run,
        "backbone": str(runs / "timelines" / "latest" / "checkpoints" / "best.pt"),
        "head": str(runs / "timelines_head" / "latest" / "checkpoints" / "best.pt"),
    }


def last_row(run_dir) -> dict:
    with open(os.path.join(run_dir, "latest", "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))[-1]


def test_a_head_trained_on_features_beats_per_chunk_classification(two_stage):
    per_chunk = last_row(two_stage["runs"] / "timelines")
    head = last_row(two_stage["runs"] / "timelines_head")
    # the labels need the segment before: a chunk alone cannot tell them (datasets/segmentation_task.py)
    assert float(head["val_seg_f1@50"]) >= float(per_chunk["val_seg_f1@50"]) + 15, (per_chunk, head)
    assert float(head["val_seg_edit"]) > float(per_chunk["val_seg_edit"])
    log = two_stage["results"][4].stderr
    assert "training on features:" in log and "from the backbone checkpoint" in log
    assert "memory: a training step on features, batch 1 padded to the longest video (15 chunks" in log
    ckpt = load_checkpoint(two_stage["head"])
    assert os.path.realpath(ckpt.features_source["checkpoint"]) == os.path.realpath(two_stage["backbone"])
    assert all(key.startswith("temporal.") for key in ckpt.model)


def test_the_head_runs_paired_with_its_backbone_and_scores_as_its_validation(two_stage):
    """infer_chunked.py on the head checkpoint alone (the docs' sixth command): the recorded backbone decodes and runs
    the videos, and the timeline scores are the ones the head's validation measured on the features."""
    shown = two_stage["results"][5].stdout
    assert "its backbone: " in shown and "timelines over 6 annotated videos" in shown
    folder = two_stage["folder"]
    scores = json.loads((folder / "timelines_scores.json").read_text())
    ckpt = load_checkpoint(two_stage["head"])
    best = max((row for row in ckpt.state.history if "val_seg_f1@50" in row), key=lambda r: r["val_seg_f1@50"])
    for key in ("frame_acc", "edit", "f1@10", "f1@25", "f1@50"):
        assert scores[key] == pytest.approx(best[f"val_seg_{key}"], abs=1e-6), key
    pictures = sorted(os.listdir(folder / "timelines"))
    assert len(pictures) == 6 and all(p.endswith(".png") for p in pictures)
    with open(folder / "timelines" / pictures[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(folder / "timelines_frames.csv", newline="") as f:
        assert sum(1 for _ in csv.DictReader(f)) == 6 * 240  # every frame of every video
    # eval.py takes the pair alike (the seventh), and reports the timeline scores
    assert "timelines (6 clips with segments)" in two_stage["results"][6].stdout


def test_a_mismatched_backbone_is_refused_with_one_line(two_stage, tmp_path):
    other = tmp_path / "other.pt"
    ckpt = load_checkpoint(two_stage["backbone"])
    ckpt.state.history = ckpt.state.history + [{"epoch": 99}]  # the same network, another file: another sha256
    save_checkpoint(ckpt, other)
    done = run_in_process(
        [
            "infer_chunked.py",
            "--checkpoint",
            two_stage["head"],
            "--backbone",
            str(other),
            "--input",
            os.path.join(two_stage["data"], "seg_val.jsonl"),
        ]
    )
    assert done.returncode == 2
    [line] = error_lines(done.stderr)
    assert "refused: its temporal head was trained on the features of backbone sha256" in line
    assert str(other) in line and "--backbone" in line


def test_training_on_features_resumes_exactly(two_stage, tmp_path):
    runs = ["--set", f"trainer.output_dir={tmp_path}", "--set", "train.max_epochs=4"]
    args = [
        "train.py",
        "--config",
        "configs/timelines-head.yaml",
        *two_stage["head_run"],
        *runs,
        "--set",
        "experiment=whole",
    ]
    assert run_in_process(args).returncode == 0
    whole = last_row(tmp_path / "whole")
    assert run_in_process(args + ["--set", "experiment=parts", "--stop-after-steps", "5"]).returncode == 0
    assert run_in_process(args + ["--set", "experiment=parts", "--resume", "auto"]).returncode == 0
    resumed = last_row(tmp_path / "parts")
    for key in ("train_loss", "val_seg_f1@50", "val_seg_edit", "val_seg_frame_acc"):
        assert float(resumed[key]) == pytest.approx(float(whole[key]), rel=1e-6), key


def test_features_of_videos_with_one_label_train_every_chunk_on_it(two_stage, tmp_path):
    """A manifest line with a label and no segments: every chunk carries the video's label, no timeline is scored."""
    from datasets.manifest import read_manifest
    from engine.data.feature_files import FeaturesDataset, index_features

    videos = [json.loads(line)["video"] for line in open(os.path.join(two_stage["data"], "seg_val.jsonl"))]
    manifest = tmp_path / "labels.jsonl"
    manifest.write_text(
        "".join(json.dumps({"video": os.path.join(two_stage["data"], v), "label": "green"}) + "\n" for v in videos)
    )
    files, _ = index_features(os.path.join(two_stage["data"], "features"))
    classes = ["red", "green"]
    sample = FeaturesDataset(read_manifest(str(manifest)), files, classes, "val", "features")[0]
    assert sample["label"] == 1 and not sample["has_segments"]
    assert sample["chunk_labels"].tolist() == [1] * len(sample["features"])
