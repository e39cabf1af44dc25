"""Per-frame timelines, the tcn head, batches of whole videos' features, the planner's estimate of a run on them.
The two-stage path itself (docs/timelines.md's commands, run as written) is tests/test_two_stage.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import train
from engine.data.feature_files import collate_features
from engine.inference.timeline import frame_probabilities, segments_of_frames
from engine.training.step import label_loss
from models.temporal import TCN_STAGES, temporal_head

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
    assert segments == [
        {"start": 1, "end": 3, "start_sec": 0.5, "end_sec": 1.5, "label": "a"},
        {"start": 3, "end": 6, "start_sec": 1.5, "end_sec": 3.0, "label": "b"},
        {"start": 7, "end": 8, "start_sec": 3.5, "end_sec": 4.0, "label": "a"},
    ]


# ------------------------------------------------------------------------------------------- the tcn head


def test_tcn_padding_changes_nothing_in_the_real_chunks_and_its_loss_counts_every_stage():
    torch.manual_seed(0)
    head = temporal_head(8, 3, kind="tcn").eval()
    short, windows = torch.randn(1, 5, 8), torch.arange(10.0).view(1, 5, 2)
    alone = head(short, windows)
    padded = torch.cat([short, torch.randn(1, 3, 8)], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    together = head(padded, torch.zeros(1, 8, 2), mask)
    assert torch.allclose(together.chunks[:, :5], alone.chunks, atol=1e-5)
    assert torch.allclose(together.clip, alone.clip, atol=1e-5)
    assert len(together.stages) == TCN_STAGES and together.stages[-1] is together.chunks
    # the multi-stage loss: each stage's cross-entropy on the labelled real chunks, plus the smoothing term
    outputs = together
    piece = {"chunk_labels": torch.tensor([[0, 0, 1, -1, 2, -1, -1, -1]]), "mask": mask}
    train_cfg = type("T", (), {"chunk_loss": "dense"})()
    loss = label_loss(outputs, piece, None, train_cfg, torch.nn.CrossEntropyLoss())
    labels = piece["chunk_labels"][0]
    counted = labels >= 0
    cross_entropy = sum(torch.nn.functional.cross_entropy(s[0][counted], labels[counted]) for s in together.stages)
    assert float(loss.detach()) > float(cross_entropy.detach())  # the smoothing adds to it
    assert float(loss.detach()) < float(cross_entropy.detach()) + 0.15 * 16 * TCN_STAGES


def test_feature_batches_pad_with_a_mask_and_label_padding_minus_one():
    samples = [
        {
            "features": torch.ones(n, 4),
            "windows": torch.ones(n, 2),
            "chunk_labels": torch.zeros(n).long(),
            "frame_labels": torch.zeros(3 * n).long(),
            "label": 1,
            "video_index": i,
            "has_segments": i == 0,
        }
        for i, n in enumerate((2, 5))
    ]
    batch = collate_features(samples)
    assert batch["features"].shape == (2, 5, 4) and batch["mask"].sum(dim=1).tolist() == [2, 5]
    assert batch["chunk_labels"][0].tolist() == [0, 0, -1, -1, -1]
    # timeline scores only where the manifest gave segments: the second video's frame labels stay -1
    assert (batch["frame_labels"][1] == -1).all() and (batch["frame_labels"][0, :6] == 0).all()


def test_the_tcn_step_memory_the_planner_estimates_is_linear_in_video_length():
    """A whole recorded session is one sample: 50,000 frames are about 2,000 chunks. MS-TCN's activations grow with
    the chunks, linearly (a transformer's attention would grow with their square)."""
    from config import load_config
    from planner.features import feature_training_estimate

    cfg = load_config("configs/timelines-head.yaml")
    short, long = (feature_training_estimate(cfg, train.STEP, 512, chunks, 1, 9) for chunks in (1000, 2000))
    assert long.parameters == short.parameters
    assert 1.9 < long.activations / short.activations < 2.1


def test_a_head_trained_alone_on_features_trains_at_train_lr():
    from config import load_config
    from engine.training.optim import build_optimizer
    from models import build_feature_head

    cfg = load_config("configs/timelines-head.yaml", ["train.lr=0.002"])
    optimizer = build_optimizer(build_feature_head(cfg.model, 64, 9), cfg.train)
    assert [group["lr"] for group in optimizer.param_groups] == [0.002, 0.002]
    assert {group["name"] for group in optimizer.param_groups} == {"model"}


def test_bad_features_directories_and_flags_say_what_to_do(tmp_path):
    import infer_chunked
    from core.errors import ConfigError, UsageError
    from datasets.manifest import VideoRecord
    from engine.data.feature_files import FeaturesDataset, index_features

    with pytest.raises(ConfigError) as info:
        index_features(str(tmp_path))
    assert str(info.value) == (
        f"data.features_dir={tmp_path}: no .npz features files there; write them with python "
        f"infer_chunked.py --checkpoint BACKBONE.pt --input MANIFEST --features {tmp_path}"
    )
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(
        UsageError,
        match=f"^{tmp_path / 'other.npz'}: not a features file of this tool .*; write it "
        f"with infer_chunked.py --features$",
    ):
        index_features(str(tmp_path))
    record = VideoRecord({"video": str(tmp_path / "a.mp4")}, label="red", where="val.jsonl:1")
    with pytest.raises(ConfigError) as info:
        FeaturesDataset([record], {}, ["red"], "val", "feats")
    assert str(info.value) == (
        f"data.features_dir=feats: no features file for 1 of the 1 val videos (first: "
        f"{tmp_path / 'a.mp4'}, val.jsonl:1); write them with: python infer_chunked.py "
        f"--checkpoint BACKBONE.pt --input <the val manifest> --features feats"
    )
    with pytest.raises(UsageError) as info:
        infer_chunked.parse_args(["--plot", "pictures"])
    assert str(info.value) == "--plot pictures: plots a timeline; add --timeline"
    with pytest.raises(UsageError) as info:
        infer_chunked.parse_args(["--timeline", "--plot", "pictures", "--plot-row-minutes", "0"])
    assert str(info.value) == ("--plot-row-minutes 0: give the minutes of video a row shows, more than 0 (default 5)")
