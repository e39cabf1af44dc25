"""The README's commands, run as written, in order, in a fresh workspace: the demo's steps (the Makefile's demo
recipe), the everyday commands, the memory planner's and the feature extraction's. So the docs cannot drift from the
code (docs/timelines.md's two-stage path: test_two_stage.py)."""

import os

import pytest
import torch
from doc_commands import bash_blocks, demo_recipe, fresh_workspace, run


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return fresh_workspace(tmp_path_factory)


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
            # a GPU preset stops at once: on a CPU for want of CUDA, on a GPU for want of the user's folder
            cuda = torch.cuda.is_available()
            reason = "/data/my-videos/train.jsonl: not found" if cuda else "this machine has no CUDA device"
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
