"""The README's and the docs' commands, run as written, in order, in a fresh workspace: after the demo's steps (the
Makefile's demo recipe), the everyday commands, the memory planner's and the feature extraction's. So the docs
cannot drift from the code."""
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

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
    return [line.strip().replace("$(PY)", "python").replace("$(DATA)", "data/synthetic")
            for line in recipe.splitlines()]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A fresh checkout's view: the project's files linked into an empty folder (runs/ and data/ are its own)."""
    folder = tmp_path_factory.mktemp("workspace")
    for name in os.listdir(ROOT):
        if name not in (".venv", "runs", "data", ".git") and not name.startswith("."):
            os.symlink(os.path.join(ROOT, name), folder / name)
    return folder


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
