"""The README's and the docs' commands, run as written, in order, in a fresh workspace: after the demo's steps (the
Makefile's demo recipe), the everyday commands, the memory planner's and the feature extraction's; the two-stage
timeline path of docs/timelines.md, with what its runs must show. So the docs cannot drift from the code."""

import csv
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import error_lines, run_in_process

from artifacts.checkpoint import load_checkpoint, save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPS = "--interval"  # the README's eval.py loop never ends by design: not run


def section_lines(page: str, heading: str) -> list[str]:
    """The lines under ``heading`` (a whole heading line) of ``page`` (a path from the repository's root), up to the
    next heading outside a code block."""
    lines = open(os.path.join(ROOT, page)).read().splitlines()
    start = lines.index(heading) + 1
    body, in_code = [], False
    for line in lines[start:]:
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            break
        body.append(line)
    return body


def bash_blocks(page: str, heading: str) -> list[str]:
    """The command lines of the ```bash blocks under a heading (comments and blank lines dropped)."""
    body = "\n".join(section_lines(page, heading)) + "\n"
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", body, flags=re.S):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


def demo_recipe() -> list[str]:
    """The Makefile's demo recipe, its variables filled in."""
    text = open(os.path.join(ROOT, "Makefile")).read().replace("\\\n", " ")
    recipe = re.search(r"^demo:.*?\n((?:\t.*\n)+)", text, flags=re.M).group(1)
    return [
        line.strip().replace("$(PY)", "python").replace("$(DATA)", "data/synthetic") for line in recipe.splitlines()
    ]


def fresh_workspace(tmp_path_factory):
    """A fresh checkout's view: the project's files linked into an empty folder (runs/ and data/ are its own)."""
    folder = tmp_path_factory.mktemp("workspace")
    for name in os.listdir(ROOT):
        if name not in (".venv", "runs", "data", ".git") and not name.startswith("."):
            os.symlink(os.path.join(ROOT, name), folder / name)
    return folder


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return fresh_workspace(tmp_path_factory)


def run(command: str, cwd) -> subprocess.CompletedProcess:
    """A README command as a user's shell runs it, with this interpreter as `python` / `.venv/bin/python`."""
    command = re.sub(r"^\*/10 \* \* \* \* ", "", command)  # a crontab line: its command
    command = command.replace("cd /path/to/repo && ", "").replace(".venv/bin/python", "python")
    command = re.sub(r"(^|&& )python ", lambda m: f"{m.group(1)}{shlex.quote(sys.executable)} ", command)
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_readme_commands_work_as_written(workspace):
    for command in demo_recipe():
        result = run(command, workspace)
        assert result.returncode == 0, (command, result.stderr[-2000:])
    everyday = bash_blocks("README.md", "## Everyday use")
    planner = bash_blocks("docs/memory-planner.md", "# The memory planner")
    assert len(everyday) == 3 and len(planner) == 4  # the blocks were found
    for command in everyday + planner:
        result = run(command, workspace)
        if "configs/rtx5080.yaml" in command and "--probe-memory" not in command:
            # a GPU preset stops at once: on a CPU for want of CUDA, on a GPU for want of the user's data
            reason = "data.data_dir is not set" if torch.cuda.is_available() else "this machine has no CUDA device"
            assert result.returncode == 2 and reason in result.stderr, (command, result.stderr[-2000:])
            continue
        assert result.returncode == 0, (command, result.stderr[-2000:])
    log = (workspace / "runs" / "rtx5080" / "eval.log").read_text()
    assert "nothing to evaluate yet" in log  # the crontab line on its first run
    features = bash_blocks("docs/inference.md", "## Features for localization")
    assert len(features) == 4
    results = [run(command, workspace) for command in features]
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    assert sorted(os.listdir(workspace / "features")) == ["long_00.npz", "long_01.npz"]
    assert "features: 0 done, 1 skipped (already there), 0 failed" in results[2].stdout  # the rerun shard
    assert "(576 clips, 48 videos)" in results[3].stdout  # 4 clips x 3 crops of each validation video


# ------------------------------------------------------------------------------------------- two stages


@pytest.fixture(scope="module")
def two_stage(tmp_path_factory):
    """docs/timelines.md's two-stage commands, run as written in a fresh workspace (test_readme's way): the timeline
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
    runs = ["--set", f"trainer.output_dir={tmp_path}", "--set", "trainer.max_epochs=4"]
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


def test_the_features_trained_head_starts_end_to_end_training(two_stage, tmp_path):
    """model.temporal_head_init: the head's weights go into the end-to-end classifier's head."""
    from config import load_config
    from engine.training.build import init_temporal_head
    from models import build_model

    cfg = load_config("configs/timelines.yaml", ["model.temporal_head=tcn"])
    model = build_model(cfg.model, num_classes=9)
    init_temporal_head(model, two_stage["head"])
    trained = load_checkpoint(two_stage["head"]).model
    for name, value in model.temporal.state_dict().items():
        assert torch.equal(value, trained[f"temporal.{name}"]), name
    with pytest.raises(Exception, match="does not fit this one"):
        init_temporal_head(
            build_model(
                load_config("configs/timelines.yaml", ["model.temporal_head=transformer"]).model, num_classes=9
            ),
            two_stage["head"],
        )


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
