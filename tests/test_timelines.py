"""Per-frame timelines and the two-stage path: a backbone trained per chunk, its features written, a temporal head
trained on them over whole videos, then run paired with that backbone (docs/timelines.md)."""
from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest
import torch
from conftest import error_lines, run_python
from test_readme import ROOT, bash_blocks, run

from artifacts.checkpoint import load_checkpoint
from engine.feature_data import collate_features
from engine.step import training_loss
from engine.timeline import frame_probabilities, segments_of_frames
from models.temporal import TemporalHead

# ------------------------------------------------------------------------------------------- per-frame blending


def test_overlapping_chunks_that_disagree_meet_inside_the_overlap_where_their_confidences_cross():
    windows = np.array([[0, 10], [6, 16]])
    even = frame_probabilities(np.array([[0.9, 0.1], [0.1, 0.9]]), windows, 16).argmax(axis=1)
    # equally sure: the boundary at the overlap's middle (frame 8), not at either chunk's edge (6 or 10)
    assert even.tolist() == [0] * 8 + [1] * 8
    # the second chunk less sure: the first one's label reaches further into the overlap
    unsure = frame_probabilities(np.array([[0.9, 0.1], [0.3, 0.7]]), windows, 16).argmax(axis=1)
    boundary = int(np.argmax(unsure == 1))
    assert 8 < boundary < 10


def test_every_frame_is_covered_and_each_row_is_a_distribution():
    # a frame stride of 2 leaves frame 7 between two chunks, and 15 after the last chunk's last frame
    probs = np.array([[0.8, 0.2], [0.3, 0.7]])
    per_frame = frame_probabilities(probs, np.array([[0, 7], [8, 15]]), 16)
    assert np.allclose(per_frame.sum(axis=1), 1.0)
    assert per_frame[7].tolist() == pytest.approx(probs[0].tolist())  # the chunk before the gap
    assert per_frame[15].tolist() == pytest.approx(probs[1].tolist())  # the last chunk, to the video's end
    with pytest.raises(ValueError, match="2 chunk predictions for 1 windows"):
        frame_probabilities(probs, np.array([[0, 7]]), 16)


def test_segments_of_frames_are_runs_in_frames_and_seconds_without_the_unannotated():
    segments = segments_of_frames(np.array([-1, 0, 0, 1, 1, 1, -1, 0]), fps=2.0, class_names=["a", "b"])
    assert segments == [{"start": 1, "end": 3, "start_sec": 0.5, "end_sec": 1.5, "label": "a"},
                        {"start": 3, "end": 6, "start_sec": 1.5, "end_sec": 3.0, "label": "b"},
                        {"start": 7, "end": 8, "start_sec": 3.5, "end_sec": 4.0, "label": "a"}]


# ------------------------------------------------------------------------------------------- the tcn head


def test_tcn_padding_changes_nothing_in_the_real_chunks_and_its_loss_counts_every_stage():
    torch.manual_seed(0)
    head = TemporalHead(8, 3, kind="tcn", width=16, stages=3, tcn_layers=4).eval()
    short, windows = torch.randn(1, 5, 8), torch.arange(10.0).view(1, 5, 2)
    alone = head(short, windows)
    padded = torch.cat([short, torch.randn(1, 3, 8)], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    together = head(padded, torch.zeros(1, 8, 2), mask)
    assert torch.allclose(together.chunks[:, :5], alone.chunks, atol=1e-5)
    assert torch.allclose(together.clip, alone.clip, atol=1e-5)
    assert len(together.stages) == 3 and together.stages[-1] is together.chunks
    # the multi-stage loss: each stage's cross-entropy on the labelled real chunks, plus the smoothing term
    outputs = {"clip": together.clip, "chunks": together.chunks.transpose(0, 1),
               "stages": [s.transpose(0, 1) for s in together.stages]}
    piece = {"chunk_labels": torch.tensor([[0, 0, 1, -1, 2, -1, -1, -1]]), "mask": mask}
    train_cfg = type("T", (), {"chunk_loss": "dense"})()
    loss = training_loss(outputs, piece, None, train_cfg, torch.nn.CrossEntropyLoss())
    labels = piece["chunk_labels"][0]
    counted = labels >= 0
    cross_entropy = sum(torch.nn.functional.cross_entropy(s[0][counted], labels[counted]) for s in together.stages)
    assert float(loss.detach()) > float(cross_entropy.detach())  # the smoothing adds to it
    assert float(loss.detach()) < float(cross_entropy.detach()) + 0.15 * 16 * 3


def test_feature_batches_pad_with_a_mask_and_label_padding_minus_one():
    samples = [{"features": torch.ones(n, 4), "windows": torch.ones(n, 2), "chunk_labels": torch.zeros(n).long(),
                "frame_labels": torch.zeros(3 * n).long(), "label": 1, "video_index": i, "has_segments": i == 0}
               for i, n in enumerate((2, 5))]
    batch = collate_features(samples)
    assert batch["features"].shape == (2, 5, 4) and batch["mask"].sum(dim=1).tolist() == [2, 5]
    assert batch["chunk_labels"][0].tolist() == [0, 0, -1, -1, -1]
    # timeline scores only where the manifest gave segments: the second video's frame labels stay -1
    assert (batch["frame_labels"][1] == -1).all() and (batch["frame_labels"][0, :6] == 0).all()


# ------------------------------------------------------------------------------------------- two stages


@pytest.fixture(scope="module")
def two_stage(tmp_path_factory):
    """docs/timelines.md's two-stage commands, run as written in a fresh workspace (test_readme's way): the timeline
    task (12 training, 6 validation videos of 240 frames), a backbone trained per chunk (configs/timelines.yaml), its
    features, a tcn head trained on them (configs/timelines-head.yaml), the pair run on the validation videos."""
    folder = tmp_path_factory.mktemp("workspace")
    for name in os.listdir(ROOT):
        if name not in (".venv", "runs", "data", ".git") and not name.startswith("."):
            os.symlink(os.path.join(ROOT, name), folder / name)
    commands = bash_blocks("docs/timelines.md", "## Two stages: features, then a temporal model over whole videos")
    assert len(commands) == 7
    results = []
    for command in commands:
        results.append(run(command, folder))
        assert results[-1].returncode == 0, (command, results[-1].stderr[-2000:])
    runs, data = folder / "runs", str(folder / "data" / "segmentation")
    head_run = ["--set", f"data.data_dir={data}", "--set", f"data.features_dir={data}/features"]
    return {"data": data, "runs": runs, "folder": folder, "results": results, "head_run": head_run,
            "backbone": str(runs / "timelines" / "latest" / "checkpoints" / "best.pt"),
            "head": str(runs / "timelines_head" / "latest" / "checkpoints" / "best.pt")}


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
    state = load_checkpoint(two_stage["head"])
    assert os.path.realpath(state["features_source"]["checkpoint"]) == os.path.realpath(two_stage["backbone"])
    assert all(key.startswith("temporal.") for key in state["model"])


def test_the_head_runs_paired_with_its_backbone_and_scores_as_its_validation(two_stage):
    """infer_chunked.py on the head checkpoint alone (the docs' sixth command): the recorded backbone decodes and runs
    the videos, and the timeline scores are the ones the head's validation measured on the features."""
    shown = two_stage["results"][5].stdout
    assert "its backbone: " in shown and "timelines over 6 annotated videos" in shown
    folder = two_stage["folder"]
    scores = json.loads((folder / "timelines_scores.json").read_text())
    state = load_checkpoint(two_stage["head"])
    best = max((row for row in state["history"] if "val_seg_f1@50" in row), key=lambda r: r["val_seg_f1@50"])
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
    state = load_checkpoint(two_stage["backbone"])
    state["history"] = state["history"] + [{"epoch": 99}]  # the same network, another file: another sha256
    torch.save(state, other)
    done = run_python(["infer_chunked.py", "--checkpoint", two_stage["head"], "--backbone", str(other), "--input",
                       os.path.join(two_stage["data"], "seg_val.jsonl")])
    assert done.returncode == 2
    [line] = error_lines(done.stderr)
    assert "refused: its temporal head was trained on the features of backbone sha256" in line
    assert str(other) in line and "--backbone" in line


def test_training_on_features_resumes_exactly(two_stage, tmp_path):
    runs = ["--set", f"trainer.output_dir={tmp_path}", "--set", "trainer.max_epochs=4"]
    args = ["train.py", "--config", "configs/timelines-head.yaml", *two_stage["head_run"], *runs,
            "--set", "experiment=whole"]
    assert run_python(args).returncode == 0
    whole = last_row(tmp_path / "whole")
    assert run_python(args + ["--set", "experiment=parts", "--stop-after-steps", "5"]).returncode == 0
    assert run_python(args + ["--set", "experiment=parts", "--resume", "auto"]).returncode == 0
    resumed = last_row(tmp_path / "parts")
    for key in ("train_loss", "val_seg_f1@50", "val_seg_edit", "val_seg_frame_acc"):
        assert float(resumed[key]) == pytest.approx(float(whole[key]), rel=1e-6), key


def test_the_features_trained_head_starts_end_to_end_training(two_stage, tmp_path):
    """model.temporal_head_init: the head's weights go into the end-to-end classifier's head."""
    from config import load_config
    from engine.build import init_temporal_head
    from models import build_model
    cfg = load_config("configs/timelines.yaml", ["model.temporal_head=tcn"])
    model = build_model(cfg.model, num_classes=9)
    init_temporal_head(model, two_stage["head"])
    trained = load_checkpoint(two_stage["head"])["model"]
    for name, value in model.temporal.state_dict().items():
        assert torch.equal(value, trained[f"temporal.{name}"]), name
    with pytest.raises(Exception, match="does not fit this one"):
        init_temporal_head(build_model(load_config("configs/timelines.yaml", ["model.temporal_head=transformer"]).model,
                                       num_classes=9), two_stage["head"])


def test_the_tcn_step_memory_the_planner_estimates_is_linear_in_video_length():
    """A whole recorded session is one sample: 50,000 frames are about 2,000 chunks. MS-TCN's activations grow with
    the chunks, linearly (a transformer's attention would grow with their square)."""
    from config import load_config
    from planner.features import feature_training_estimate
    cfg = load_config("configs/timelines-head.yaml")
    short, long = (feature_training_estimate(cfg, 512, chunks, 1, 9) for chunks in (1000, 2000))
    assert long.parameters == short.parameters
    assert 1.9 < long.activations / short.activations < 2.1
