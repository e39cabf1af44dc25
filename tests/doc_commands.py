"""Running the docs' commands as written: the ```bash blocks under a heading of a page, the Makefile's demo recipe,
a fresh workspace (a checkout's view with runs/ and data/ of its own) and a shell's way of running a line. Used by
the tests that run the README's and the docs' commands (test_readme.py, test_two_stage.py, test_mstcn.py,
test_prepared.py)."""

import os
import re
import shlex
import subprocess
import sys

import yaml
from conftest import run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def fresh_workspace(tmp_path_factory, name: str = "workspace", configs: dict | None = None):
    """A fresh checkout's view: the project's files linked into an empty folder (runs/ and data/ are its own). With
    ``configs`` ({file name: preset}), configs/ is a folder of its own too, which a test may add presets to: each
    preset the project's own (linked), but those of ``configs``, written as given."""
    folder = tmp_path_factory.mktemp(name)
    own = ("configs",) if configs is not None else ()
    for entry in os.listdir(ROOT):
        if entry not in (".venv", "runs", "data", ".git", *own) and not entry.startswith("."):
            os.symlink(os.path.join(ROOT, entry), folder / entry)
    if configs is not None:
        (folder / "configs").mkdir()
        for entry in os.listdir(os.path.join(ROOT, "configs")):
            if entry in configs:
                (folder / "configs" / entry).write_text(yaml.safe_dump(configs[entry]))
            else:
                os.symlink(os.path.join(ROOT, "configs", entry), folder / "configs" / entry)
    return folder


# what makes a line more than one `python ...` call: left to bash
SHELL_SYNTAX = re.compile(r"[&|;<>$`*\\]")


def run(command: str, cwd) -> subprocess.CompletedProcess:
    """A README command as a user's shell runs it, with this interpreter as `python` / `.venv/bin/python`. A line
    that is one `python ...` call and nothing else runs in this interpreter (conftest's run_in_process: the same
    arguments as the shell would split them, the same code path, without a new interpreter's seconds of imports);
    anything with shell syntax (`&&`, redirections, a crontab line) runs in bash."""
    command = re.sub(r"^\*/10 \* \* \* \* ", "", command)  # a crontab line: its command
    command = command.replace("cd /path/to/repo && ", "").replace(".venv/bin/python", "python")
    if command.startswith("python ") and not SHELL_SYNTAX.search(command):
        return run_in_process(shlex.split(command)[1:], cwd=str(cwd))
    command = re.sub(r"(^|&& )python ", lambda m: f"{m.group(1)}{shlex.quote(sys.executable)} ", command)
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=600)
