"""train.objective: motion: the pasted patches, the objective learnt, the stage in train.py (resume, the
out-of-memory back-off, the planner, eval.py) and docs/pretraining.md's commands as written."""

import json
import math
import os

import pytest
import torch
import yaml
from conftest import error_lines, run_in_process
from doc_commands import ROOT, bash_blocks, fresh_workspace, run

from artifacts.checkpoint import load_checkpoint
from core.metric_names import MOTION_METRICS
from engine.training.motion_pretext import paste_moving_patches

PAGE = "docs/pretraining.md"


def noise_clips(batch=4, frames=16, size=32, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, frames, size, size), dtype=torch.uint8, generator=generator)


def patch_centres(before: torch.Tensor, after: torch.Tensor) -> dict[int, tuple[float, float]]:
    """{frame: (x, y)} of the changed pixels' centre in each frame of one clip [C, T, H, W] where any changed."""
    changed = (before != after).any(dim=0)  # [T, H, W]
    centres = {}
    for t in range(changed.shape[0]):
        ys, xs = torch.nonzero(changed[t], as_tuple=True)
        if len(xs):
            centres[t] = (xs.float().mean().item(), ys.float().mean().item())
    return centres


def test_each_chunk_s_patch_moves_the_way_its_direction_says_inside_its_chunk_and_the_input_is_kept():
    video = noise_clips(batch=6, frames=24)
    kept = video.clone()
    chunks = [(2, 12), (12, 22)]
    pasted, directions = paste_moving_patches(video, chunks, seed=7)
    assert torch.equal(video, kept)  # the loader's clip is not changed
    assert directions.shape == (6, 2, 2)
    torch.testing.assert_close(directions.norm(dim=-1), torch.ones(6, 2))
    for frame in (0, 1, 22, 23):  # outside every chunk window: untouched
        assert torch.equal(pasted[:, :, frame], video[:, :, frame])
    angles = set()
    for i in range(6):
        centres = patch_centres(video[i], pasted[i])
        for j, (start, end) in enumerate(chunks):
            inside = sorted(t for t in centres if start <= t < end)
            assert len(inside) >= 3 and inside == list(range(inside[0], inside[-1] + 1))  # seen in a run of frames
            (x0, y0), (x1, y1) = centres[inside[0]], centres[inside[-1]]
            moved = torch.tensor([x1 - x0, y1 - y0])
            assert moved.norm() > 2  # it travels
            assert float(moved @ directions[i, j]) / float(moved.norm()) > 0.95  # x right, y down
            angles.add(round(math.atan2(directions[i, j, 1], directions[i, j, 0]), 6))
    assert len(angles) == 12  # every patch its own direction
    again, same = paste_moving_patches(video, chunks, seed=7)
    assert torch.equal(again, pasted) and torch.equal(same, directions)  # a recomputed or resumed step: the same
    other, _ = paste_moving_patches(video, chunks, seed=8)
    assert not torch.equal(other, pasted)


def pretraining_args(root, out, *extra):
    args = ["--config", os.path.join(ROOT, "configs", "pretrain.yaml")]
    for item in (
        f"data.data_dir={root}",
        f"trainer.output_dir={out}",
        "data.num_frames=8",
        "data.num_workers=0",
        "data.sample_timeout_s=null",
        "data.batch_size=4",
        "model.width=8",
        "train.chunk_train_size=4",
        "train.max_epochs=2",
        "trainer.plots=false",
        *extra,
    ):
        args += ["--set", item]
    return args


def test_pretraining_resumes_exactly_and_its_checkpoint_is_the_objective_s(synthetic_root, tmp_path):
    import train

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert train.main(pretraining_args(synthetic_root, straight)) == 0
    args = pretraining_args(synthetic_root, stopped)
    assert train.main(args + ["--stop-after-steps", "3"]) == 0  # in the middle of epoch 1
    assert train.main(args + ["--resume", "auto"]) == 0
    reference = load_checkpoint(str(straight / "pretrain" / "latest" / "checkpoints" / "last.pt"))
    resumed = load_checkpoint(str(stopped / "pretrain" / "latest" / "checkpoints" / "last.pt"))
    assert resumed.state.global_step == reference.state.global_step > 3
    for key, value in reference.model.items():
        torch.testing.assert_close(resumed.model[key], value, rtol=0, atol=0, msg=key)
    history = reference.state.history
    assert [row["val_direction_acc"] for row in resumed.state.history] == [row["val_direction_acc"] for row in history]
    assert all(0 <= row["val_direction_acc"] <= 1 and row["val_loss"] >= 0 for row in history)
    assert {f"val_{name}" for name in MOTION_METRICS} <= set(history[0])  # the names plots and train.monitor use
    assert reference.class_names == ["direction_x", "direction_y"]
    saved = yaml.safe_load(open(straight / "pretrain" / "latest" / "config.yaml"))
    assert saved["model"]["temporal_head"] == "none" and saved["train"]["monitor"] == "val_direction_acc"
    assert not any(key.startswith("temporal.") for key in reference.model)


def test_an_out_of_memory_pretraining_step_is_retried_at_half_the_clips_per_forward(
    synthetic_root, tmp_path, monkeypatch
):
    import train
    from engine.training.motion_pretext import MotionPretextForward
    from engine.training.oom import OutOfMemoryError

    forward, batches = MotionPretextForward.forward, []

    def out_of_memory_above_2_clips(self, inputs, spec, samples=None):
        batches.append(inputs["video"].shape[0])
        if batches[-1] > 2:
            raise OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(self, inputs, spec, samples)

    monkeypatch.setattr(MotionPretextForward, "forward", out_of_memory_above_2_clips)
    assert train.main(pretraining_args(synthetic_root, tmp_path)) == 0
    # backed off once, then kept: 4 steps of 2 forwards in each of 2 epochs; validation's forwards hold 1 clip
    assert batches[0] == 4 and batches.count(2) == 16 and set(batches[1:]) == {1, 2}
    saved = load_checkpoint(str(tmp_path / "pretrain" / "latest" / "checkpoints" / "last.pt"))
    assert saved.state.micro_splits == 2
    assert len(saved.state.history) == 2  # both epochs trained, none lost to the back-off
    assert all(0 <= row["val_direction_acc"] <= 1 for row in saved.state.history)


@pytest.mark.parametrize(
    "changes, key",
    [
        (["train.chunk_train_size=2"], "train.chunk_train_size: 2"),
        (["model.input_type=rgb_kpt", "data.load_kpt=true"], "model.input_type: rgb_kpt"),
        (["model.view_fusion=mean"], "model.view_fusion: mean"),
    ],
)
def test_what_cannot_show_motion_is_refused_in_one_line(synthetic_root, tmp_path, changes, key):
    result = run_in_process(["train.py", *pretraining_args(synthetic_root, tmp_path, *changes)])
    assert result.returncode == 2
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and key in lines[0] and "train.objective: motion" in lines[0]


def test_the_planner_estimates_the_pretraining_step(synthetic_root, tmp_path):
    result = run_in_process(
        ["train.py", *pretraining_args(synthetic_root, tmp_path), "--probe-memory", "--probe-frames", "8,16"]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "largest batch" in result.stdout.lower() or "fits" in result.stdout.lower(), result.stdout[-2000:]


# ----------------------------------------------------------------------------------- docs/pretraining.md as written
CPU_STAND_IN = {  # what the page's commands need on a test's clock; the page's own keys stay as the configs have them
    "data": {"num_frames": 8, "num_workers": 0, "sample_timeout_s": None, "batch_size": 4},
    "model": {"width": 8},
    "train": {"max_epochs": 2, "chunk_train_size": 4},
    "trainer": {"plots": False},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A fresh checkout's view whose configs/pretrain.yaml and quickstart.yaml are CPU stand-ins of themselves, a
    folder of footage whose manifest has no label, and a labelled folder."""
    from datasets.synthetic import generate

    stand_ins = {}
    for name in ("pretrain.yaml", "quickstart.yaml"):
        preset = yaml.safe_load(open(os.path.join(ROOT, "configs", name)))
        for section, values in CPU_STAND_IN.items():
            preset.setdefault(section, {}).update(values)
        stand_ins[name] = preset
    folder = fresh_workspace(tmp_path_factory, "pretraining", configs=stand_ins)
    footage, labelled = folder / "stand-in" / "footage", folder / "stand-in" / "labelled"
    generate(str(footage), seed=11, size=32, num_train=30, num_val=0, num_test=0, short_frames=24, num_long=0,
             num_multiview=0, quiet=True)  # fmt: skip
    lines = [json.loads(line) for line in open(footage / "train.jsonl")]
    with open(footage / "train.jsonl", "w") as f:  # the videos alone
        f.writelines(json.dumps({"video": entry["video"]}) + "\n" for entry in lines)
    generate(str(labelled), seed=12, size=32, num_train=18, num_val=6, num_test=0, short_frames=20, num_long=0,
             num_multiview=0, quiet=True)  # fmt: skip
    return folder, {"/data/footage": str(footage), "/data/labelled": str(labelled)}


def test_the_page_s_commands_run_as_written(workspace):
    folder, stand_ins = workspace
    commands = bash_blocks(PAGE, "## The commands, in order")
    assert len(commands) == 3
    results = []
    for command in commands:
        for path, stand_in in stand_ins.items():
            command = command.replace(path, stand_in)
        results.append(run(command, folder))
        assert results[-1].returncode == 0, (command, results[-1].stdout[-2000:], results[-1].stderr[-2000:])
    pretrained = load_checkpoint(str(folder / "runs" / "pretrain" / "latest" / "checkpoints" / "best.pt"))
    history = pretrained.state.history
    best = max(row["val_direction_acc"] for row in history)
    # eval.py reads the same held-out videos and pastes the same patches as the run's validation did
    assert f"direction acc {best:.4f}" in results[1].stdout, results[1].stdout
    assert "pretrained tiny3d: 18 of 18 tensors loaded" in results[2].stderr + results[2].stdout
    tuned = load_checkpoint(str(folder / "runs" / "quickstart" / "latest" / "checkpoints" / "last.pt"))
    assert tuned.class_names == ["down", "grow", "left", "right", "shrink", "up"]
    assert tuned.config["model"]["pretrained"].endswith("runs/pretrain/latest/checkpoints/best.pt")
    (another,) = bash_blocks(PAGE, "## Another preset's backbone")
    result = run(another, folder)
    # a GPU preset stops at once: on a CPU for want of CUDA, on a GPU for want of the user's folder
    reason = "/data/footage/train.jsonl: not found" if torch.cuda.is_available() else "this machine has no CUDA device"
    assert result.returncode == 2 and reason in result.stderr, result.stderr[-2000:]
    # from cron: each checkpoint scored by the objective
    result = run("python eval.py --watch runs/pretrain/latest --settle 0", folder)  # checkpoints seconds old
    assert result.returncode == 0, result.stderr[-2000:]
    entries = [json.loads(line) for line in open(folder / "runs" / "pretrain" / "latest" / "eval.jsonl")]
    assert len(entries) == 2 and all(e["status"] == "ok" for e in entries)  # two epochs (last.pt, best.pt: copies)
    assert {e["metrics"]["direction_acc"] for e in entries} <= {row["val_direction_acc"] for row in history}
    # a backbone pretrained without labels predicts no class
    best = "runs/pretrain/latest/checkpoints/best.pt"
    result = run(f"python infer_chunked.py --checkpoint {best} --input {stand_ins['/data/labelled']}/videos", folder)
    assert result.returncode == 2
    (line,) = error_lines(result.stderr)
    assert "predicts no class" in line and f"model.pretrained={best}" in line


def test_a_manifest_without_labels_reads_only_where_no_label_is_read(tmp_path):
    from datasets.manifest import ManifestError, read_manifest

    jsonl, csv_file = tmp_path / "m.jsonl", tmp_path / "m.csv"
    jsonl.write_text('{"video": "a.mp4"}\n{"video": "b.mp4", "label": "x"}\n')
    csv_file.write_text("video,camera\na.mp4,1\n")
    for path in (jsonl, csv_file):
        with pytest.raises(ManifestError, match="label"):
            read_manifest(str(path))
    assert [r.label for r in read_manifest(str(jsonl), labelled=False)] == [None, "x"]
    (record,) = read_manifest(str(csv_file), labelled=False)
    assert record.label is None and record.extra == {"camera": "1"}
