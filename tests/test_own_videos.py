"""docs/own-videos.md run as a new user would: its preset written to configs/my-videos.yaml, its commands in order,
as written, on a small generated folder standing in for /data/my-videos (labelled videos of six patients, a folder of
new ones). The preset's GPU recipe is swapped for a CPU-sized one in the same file (no GPU, no network in tests): the
keys the page sets are the page's."""

import csv
import json
import os
import shutil

import pytest
import yaml
from doc_commands import bash_blocks, fresh_workspace, run, section_lines

PAGE = "docs/own-videos.md"
# what a CPU without network needs instead of the 16 GB recipe; the page's own keys stay as the page has them
CPU_STAND_IN = {
    "model": {"backbone": "tiny3d", "width": 8, "pretrained": None},
    "data": {
        "img_size": 32,
        "num_frames": 8,
        "max_video_frames": 16,
        "batch_size": 4,
        "num_workers": 0,
        "sample_timeout_s": None,
        "fps": 12.5,
    },  # fmt: skip
    "train": {"max_epochs": 1, "chunk_train_size": 4},
    "infer": {"chunk_size": 4},
    "trainer": {"device": "cpu", "memory_budget_gb": None, "precision": "32", "plots": False},
}


def page_preset() -> dict:
    text = "\n".join(section_lines(PAGE, "## A preset of your own"))
    return yaml.safe_load(text.split("```yaml\n")[1].split("```")[0])


def merged(preset: dict, stand_in: dict) -> dict:
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in preset.items()}
    for section, values in stand_in.items():
        out.setdefault(section, {}).update({k: v for k, v in values.items() if k not in preset.get(section, {})})
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A fresh checkout's view whose configs/ takes a new preset, and the stand-in for /data/my-videos."""
    from datasets.synthetic import generate

    folder = fresh_workspace(tmp_path_factory, "own", configs={})
    videos = folder / "stand-in" / "my-videos"
    generate(str(videos), seed=5, size=32, num_train=24, num_val=6, num_test=0, short_frames=24, num_long=0,
             num_multiview=0, quiet=True)  # fmt: skip
    lines = [json.loads(line) for name in ("train.jsonl", "val.jsonl") for line in open(videos / name)]
    with open(videos / "train.jsonl", "w") as f:
        for i, entry in enumerate(lines):
            f.write(json.dumps({"video": entry["video"], "label": entry["label"], "patient": f"p{i // 5}"}) + "\n")
    for name in ("val.jsonl", "test.jsonl", "classes.txt"):  # the user's folder has one manifest
        if (videos / name).exists():
            os.unlink(videos / name)
    (videos / "new").mkdir()
    for entry in lines[:3]:
        shutil.copy(videos / entry["video"], videos / "new")
    return folder, str(videos)


def test_the_page_s_path_runs_as_written(workspace):
    folder, videos = workspace
    preset = page_preset()
    assert preset["base"] == "long-video-16gb.yaml" and preset["data"]["data_dir"] == "/data/my-videos"
    preset["data"]["data_dir"] = videos
    (folder / "configs" / "my-videos.yaml").write_text(yaml.safe_dump(merged(preset, CPU_STAND_IN)))
    commands = bash_blocks(PAGE, "## The commands, in order")
    assert len(commands) == 8
    for command in commands:
        result = run(command.replace("/data/my-videos", videos), folder)
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-2000:])
        if command.startswith("tail"):
            assert "val_video_mean_class_acc" in open(folder / "runs" / "my-videos" / "latest" / "metrics.csv").read()
    run_dir = folder / "runs" / "my-videos" / "latest"
    config = yaml.safe_load(open(run_dir / "config.yaml"))
    assert config["data"]["group_key"] == "patient" and config["data"]["balance"] == "classes"
    assert config["train"]["monitor"] == "val_video_mean_class_acc"
    assert os.listdir(videos + "-prepared")  # the copies were made and read
    rows = list(csv.DictReader(open(folder / "runs" / "my-videos" / "val.csv")))
    assert rows and all(row["clips"] == "1" for row in rows)  # --whole-videos: each video one sample
    validated = {row["video"] for row in rows}
    patients = {
        json.loads(line)["video"]: json.loads(line)["patient"] for line in open(os.path.join(videos, "train.jsonl"))
    }
    by_patient = {patients[os.path.relpath(v, videos)] for v in validated}
    trained = {p for v, p in patients.items() if os.path.join(videos, v) not in validated}
    assert by_patient and not by_patient & trained  # a patient on one side of the split
    table = open(folder / "runs" / "k_fold" / "my-videos" / "k_fold.md").read()
    assert table.count("\n| ") == 7 and "| mean | 5 folds |" in table  # header, 5 folds, the mean
    predicted = list(csv.DictReader(open(folder / "runs" / "my-videos" / "new.csv")))
    assert sorted(os.path.basename(row["video"]) for row in predicted) == sorted(
        os.listdir(os.path.join(videos, "new"))
    )
