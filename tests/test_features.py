"""infer_chunked.py --features: per-chunk features of whole videos, resumable, sharded, read back exactly."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from conftest import run_in_process

from artifacts.checkpoint import load_checkpoint, save_checkpoint
from artifacts.trained_model import load_trained_model
from core.shards import parse_shard, shard
from datasets.clip_transform import ClipTransform
from datasets.device_input import DeviceInputs
from datasets.manifest import VideoRecord, read_manifest
from datasets.video.choice import open_reader
from datasets.video.probe import probe
from engine.inference.chunks import chunk_windows
from engine.inference.features import feature_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def infer(*args):
    return run_in_process(["infer_chunked.py", *args])


@pytest.fixture(scope="module")
def extracted(trained_run, synthetic_root, tmp_path_factory):
    """A long video and two short clips in 2 shards, chunks of 12 clip frames sharing 4."""
    out = tmp_path_factory.mktemp("features")
    manifest = tmp_path_factory.mktemp("input") / "videos.jsonl"
    lines = [json.loads(open(os.path.join(synthetic_root, name)).readline()) for name in ("long.jsonl", "train.jsonl")]
    second = json.loads(open(os.path.join(synthetic_root, "train.jsonl")).readlines()[1])
    manifest.write_text(
        "".join(
            json.dumps(
                {
                    **line,
                    "video": os.path.join(synthetic_root, line["video"]),
                    **({"keypoints": os.path.join(synthetic_root, line["keypoints"])} if "keypoints" in line else {}),
                }
            )
            + "\n"
            for line in lines + [second]
        )
    )
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    args = ["--checkpoint", best, "--input", str(manifest), "--chunk", "12", "--overlap", "4", "--features", str(out)]
    runs = [infer(*args, "--shard", f"{i}/2") for i in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    return out, best, args, runs


def test_the_shards_together_write_every_video_once(extracted, synthetic_root):
    out, _, _, runs = extracted
    assert sorted(os.listdir(out)) == ["long_00.npz", "train_0000.npz", "train_0001.npz"]
    assert [r.stdout.count("features: ") for r in runs] == [3, 2]  # a line per file and the summary
    assert "features: 2 done, 0 skipped (already there), 0 failed; " in runs[0].stdout
    assert "features: 1 done, 0 skipped (already there), 0 failed; " in runs[1].stdout


def test_a_features_file_reads_back_against_the_chunk_arithmetic_and_a_direct_forward(extracted, synthetic_root):
    out, best, _, _ = extracted
    saved = np.load(out / "long_00.npz", allow_pickle=False)
    model, cfg, class_names, _ = load_trained_model(best, torch.device("cpu"))
    video = read_manifest(os.path.join(synthetic_root, "long.jsonl"))[0].first_path
    stride = int(saved["frame_stride"])
    reader_info = probe(video)
    clip_frames = len(range(0, reader_info.num_frames, stride))
    windows = chunk_windows(clip_frames, 12, 4)
    assert saved["features"].shape == (len(windows), model.feature_dim) and saved["features"].dtype == np.float16
    assert saved["logits"].shape == (len(windows), len(class_names))
    expected = [[s * stride, (e - 1) * stride + 1] for s, e in windows]
    assert saved["windows_frames"].tolist() == expected
    np.testing.assert_allclose(saved["windows_seconds"], np.array(expected) / float(saved["fps"]))
    assert (int(saved["chunk"]), int(saved["overlap"]), str(saved["view_fusion"])) == (12, 4, "none")
    assert json.loads(str(saved["settings"]))["checkpoint_sha256"] == str(saved["checkpoint_sha256"])
    stored = yaml.safe_load(str(saved["config"]))["infer"]  # the config that ran: --chunk 12 --overlap 4
    assert (stored["chunk_size"], stored["chunk_overlap"]) == (12, 4) != (cfg.infer.chunk_size, cfg.infer.chunk_overlap)
    # a direct forward of the same frames: decoded at evaluation's geometry, the first and the last chunk
    transform = ClipTransform(dataclasses.replace(cfg.data, test_crops=1), training=False)
    plan = transform.plan([(reader_info.height, reader_info.width)], None)[0]
    reader = open_reader(video, plan.decoded)
    prepare = DeviceInputs(torch.device("cpu"), cfg.data.mean, cfg.data.std)
    for k in (0, len(windows) - 1):
        s, e = windows[k]
        frames = torch.from_numpy(reader.read([i * stride for i in range(s, e)])).permute(0, 3, 1, 2)
        clip = transform.frames(frames, plan).permute(1, 0, 2, 3).unsqueeze(0)
        with torch.no_grad():
            direct = model.features(prepare({"video": clip}))[0].numpy()
        np.testing.assert_allclose(saved["features"][k].astype(np.float32), direct, rtol=1e-2, atol=2e-3)


def test_a_rerun_skips_what_was_done_and_other_settings_or_checkpoints_recompute(extracted, tmp_path):
    out, best, args, _ = extracted
    again = infer(*args, "--shard", "1/2")
    assert again.returncode == 0
    assert f"/train_0000.mp4: {out / 'train_0000.npz'} exists with the same settings" in again.stdout
    assert "features: 0 done, 1 skipped (already there), 0 failed" in again.stdout
    before = (out / "long_00.npz").stat().st_mtime_ns
    changed = infer(*[a if a != "12" else "16" for a in args], "--shard", "0/2")  # chunks of 16 now
    assert f"features: {out / 'long_00.npz'} (" in changed.stdout
    assert "written with other settings (chunk)" in changed.stdout
    assert (out / "long_00.npz").stat().st_mtime_ns != before
    other = tmp_path / "other.pt"  # the same weights written again: another file, another content hash
    ckpt = load_checkpoint(best)
    ckpt.state.global_step += 1
    save_checkpoint(ckpt, str(other))
    mixed = infer(*[str(other) if a == best else a for a in args], "--shard", "0/2")
    assert (
        "train_0001.npz (" in mixed.stdout and "written with other settings (checkpoint_sha256, chunk)" in mixed.stdout
    )


def test_equal_stems_get_distinct_names_and_shards_cover_the_list_once():
    records = [VideoRecord({"video": f"/data/{d}/clip.mp4"}, where="x") for d in ("a", "b")]
    records.append(VideoRecord({"video": "/data/c/other.mp4"}, where="x"))
    names = feature_names(records)
    assert names[2] == "other.npz" and names[0] != names[1] and all(n.startswith("clip-") for n in names[:2])
    items = list(range(10))
    parts = [shard(items, i, 3) for i in range(3)]
    assert sorted(sum(parts, [])) == items
    assert parse_shard("2/3") == (2, 3) and parse_shard(None) == (0, 1)


@pytest.mark.parametrize(
    "flag, message",
    [
        ("3/3", "--shard 3/3: i must be below N (3 shards are numbered 0 to 2)"),
        ("1", "--shard 1: expected i/N with 0 <= i < N, e.g. --shard 0/4 (the first of 4 shards)"),
        ("a/b", "--shard a/b: expected i/N with 0 <= i < N, e.g. --shard 0/4 (the first of 4 shards)"),
    ],
)
def test_bad_shards_are_one_line_and_exit_2(flag, message):
    result = infer("--shard", flag)
    assert result.returncode == 2 and result.stderr == f"error: {message}\n"


def test_a_features_directory_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    result = infer("--features", str(tmp_path / "f"))
    assert result.returncode == 2
    assert (
        result.stderr == f"error: --features {tmp_path / 'f'}: a file, not a directory; give a directory (created "
        f"if missing)\n"
    )
    assert (tmp_path / "f").read_text() == ""  # nothing the user gave is changed
    shutil.rmtree(tmp_path)


# ---------------------------------------------------------------------------------------- evaluation views


def test_evaluation_clips_are_evenly_spaced_over_the_window():
    from datasets.windows import clip_indices

    # window [0, 100), 4 frames at stride 2 (a span of 7): the first clip at the start, the last at the end
    starts = [int(clip_indices(0, 100, 4, 2, None, test_clip, 4)[0]) for test_clip in range(4)]
    assert starts == [0, 31, 62, 93]
    assert clip_indices(0, 100, 4, 2, None, 0, 1)[0] == 46  # one test clip: centred, as before
    assert clip_indices(10, 14, 8, 2, None, 2, 3).tolist() == clip_indices(10, 14, 8, 2, None, 0, 3).tolist()


def test_clips_times_crops_views_read_the_right_frames_and_average_by_hand(barcode_videos, tmp_path):
    """A barcoded video (each frame shows its number): each view decodes its evenly spaced frames, and the
    video-level probability is the mean of the views' softmax, computed here by hand."""
    from conftest import read_barcode

    from config import load_config
    from core.runtime import Runtime
    from datasets.video_dataset import VideoWindowDataset
    from engine.evaluation.evaluate import evaluate_dataset

    path, frames = barcode_videos["mpeg4_avi"]
    cfg = load_config(
        None,
        [
            "data.num_workers=0",
            "data.sample_timeout_s=null",
            "data.num_frames=4",
            "data.frame_stride=3",
            "data.test_clips=3",
            "data.test_crops=3",
            "data.resize=stretch",
            "data.img_size=[48, 120]",
            "infer.chunk_size=-1",
        ],
    )
    dataset = VideoWindowDataset(
        [VideoRecord({"video": path}, label="b", where="v")], ["a", "b"], cfg.data, training=False
    )
    assert len(dataset) == 9  # 3 clips x 3 crops of the one window
    span = 3 * 3 + 1
    expected_starts = [round(k * (frames - span) / 2) for k in range(3)]
    for view in range(9):
        sample = dataset[view]
        indices = sample["frame_indices"].tolist()
        assert indices == [expected_starts[view // 3] + 3 * t for t in range(4)]
        if view % 3 == 1:  # the centre crop of a stretched frame is the frame: its barcodes say which
            decoded = [read_barcode(f.permute(1, 2, 0).numpy()) for f in sample["video"].permute(1, 0, 2, 3)]
            assert decoded == indices

    class Brightness(torch.nn.Module):
        min_frames = 1

        def forward(self, inputs):
            mean = inputs["video"].mean(dim=(1, 2, 3, 4))
            return torch.stack([mean, 2 * mean.sin()], dim=1)

    runtime = Runtime(torch.device("cpu"), "32")
    metrics, view_rows, video_rows = evaluate_dataset(Brightness(), dataset, cfg, runtime, ["a", "b"])
    assert metrics["num_clips"] == 9 and len(view_rows) == 9
    prepare = DeviceInputs(torch.device("cpu"), cfg.data.mean, cfg.data.std)
    by_hand = torch.stack(
        [Brightness()(prepare({"video": dataset[v]["video"].unsqueeze(0)}))[0].softmax(0) for v in range(9)]
    ).mean(dim=0)
    assert video_rows[0]["probability"] == pytest.approx(float(by_hand.max()), abs=1e-6)
    assert video_rows[0]["predicted"] == ["a", "b"][int(by_hand.argmax())] and video_rows[0]["clips"] == 9


def test_eval_batch_auto_sizes_the_forward_for_every_view_of_a_window(trained_run):
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    result = run_in_process(
        [
            "eval.py",
            "--checkpoint",
            best,
            "--split",
            "val",
            "--clips",
            "2",
            "--crops",
            "3",
            "--batch",
            "auto",
            "--memory-budget-gb",
            "0.05",
        ],
    )
    assert result.returncode == 0, result.stderr
    fitted = int(result.stdout.split("--batch auto: ")[1].split(" chunks")[0])  # chunks for all 6 views at once
    assert fitted >= 6 and "(36 clips, 6 videos)" in result.stdout  # 2 clips x 3 crops of each of 6 videos
    refused = run_in_process(
        ["eval.py", "--checkpoint", best, "--batch", "many"],
    )
    assert refused.returncode == 2 and refused.stderr == "error: --batch many: expected a number of chunks, or auto\n"
