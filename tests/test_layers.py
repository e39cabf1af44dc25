"""The tree is the architecture. The layer order, the independence of datasets and models, the absence of cycles
inside a package and of imports of a script are import-linter's contracts in ``.importlinter`` (make test runs
``lint-imports``; the README's Layers section draws them). Here: the contracts hold, each fails when broken, and
the one rule of ours import-linter has no contract for: a function-level import says why it is there."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("core", "config", "datasets", "models", "artifacts", "engine", "planner")
SCRIPTS = ("train", "eval", "infer_chunked")
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def lint_imports(root: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--no-logo"], cwd=root, capture_output=True, text=True, timeout=120
    )


def copy_of_the_tree(folder) -> str:
    for name in PACKAGES:
        shutil.copytree(os.path.join(ROOT, name), folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in [f"{s}.py" for s in SCRIPTS] + [".importlinter"]:
        shutil.copy(os.path.join(ROOT, name), folder)
    return str(folder)


def test_the_import_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "4 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "change, extra, broken",
    [
        ("config/__init__.py", "import engine.training.run\n", "Layers"),  # an upward import
        ("datasets/manifest.py", "import models.registry\n", "Layers"),  # a sibling package of its layer
        ("core/files.py", "from core import errors\n", "No cycle"),  # with errors importing files
        ("engine/training/oom.py", "import train\n", "No package imports a script"),
        (
            "engine/evaluation/watch.py",
            "import engine.training.oom\n",
            "The engine by concept",
        ),  # evaluation under training
    ],
)
def test_each_contract_fails_when_broken(tmp_path, change, extra, broken):
    root = copy_of_the_tree(tmp_path)
    path = tmp_path / change
    path.write_text(extra + path.read_text())
    if change == "core/files.py":
        errors = tmp_path / "core" / "errors.py"
        errors.write_text("import core.files\n" + errors.read_text())
    result = lint_imports(root)
    assert result.returncode == 1 and f"{broken}" in result.stdout.split("Broken contracts")[-1], result.stdout


def function_level_imports_without_reason(root: str = ROOT) -> list[str]:
    """An import inside a function (to break a cycle, defer a heavy module, or reach an optional one) must say
    why on its line."""
    found = []
    for name in PACKAGES + SCRIPTS:
        paths = (
            [os.path.join(root, f"{name}.py")]
            if name in SCRIPTS
            else [
                os.path.join(folder, f)
                for folder, _, files in os.walk(os.path.join(root, name))
                for f in files
                if f.endswith(".py")
            ]
        )
        for path in paths:
            source = open(path).read()
            lines = source.splitlines()
            for function in ast.walk(ast.parse(source)):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1]:
                        found.append(f"{os.path.relpath(path, root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(found))


def test_function_level_imports_say_why(tmp_path):
    assert function_level_imports_without_reason() == []
    root = copy_of_the_tree(tmp_path)
    watch = tmp_path / "engine" / "evaluation" / "watch.py"
    watch.write_text("def later():\n    import json\n" + watch.read_text())
    assert function_level_imports_without_reason(root) == ["engine/evaluation/watch.py:2: import json"]


def test_every_package_is_under_the_contracts():
    import configparser  # only this test reads the contract file itself

    contracts = configparser.ConfigParser()
    contracts.read(os.path.join(ROOT, ".importlinter"))
    checked = set(contracts["importlinter"]["root_packages"].split())
    packages = {
        name
        for name in os.listdir(ROOT)
        if not name.startswith(".")
        and os.path.isdir(os.path.join(ROOT, name))
        and any(f.endswith(".py") for f in os.listdir(os.path.join(ROOT, name)))
    }
    assert packages - {"tests", "bench"} == checked == set(PACKAGES)  # tests and bench sit above every layer


def modules_in_the_tree(root: str = ROOT) -> set[str]:
    """Every module of every package, as ``package/module.py`` (``__init__.py`` left out)."""
    found = set()
    for name in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, name)):
            found |= {
                os.path.relpath(os.path.join(folder, f), root)
                for f in files
                if f.endswith(".py") and f != "__init__.py"
            }
    return found


def modules_in_the_architecture(text: str) -> set[str]:
    """The modules docs/architecture.md's listing names: under a ``package/`` line, each indented line's leading
    names (``tiny3d.py, vgg3d.py, ...`` names several)."""
    listing = text.split("```")[1]
    named, package = set(), None
    for line in listing.splitlines():
        if line.endswith("/") and not line.startswith(" "):
            package = line[:-1]
        elif not line.strip() or not line.startswith(" "):
            package = None if line.strip() else package
        elif package and line.startswith("  ") and not line.startswith("   "):
            names = re.match(r"((?:[\w/]+\.py(?:, )?)+)", line.strip())
            named |= {f"{package}/{n}" for n in names.group(1).split(", ")} if names else set()
    return named


def test_the_architecture_doc_names_every_module_and_only_modules_that_exist(tmp_path):
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    assert modules_in_the_architecture(text) == modules_in_the_tree()
    root = copy_of_the_tree(tmp_path)
    (tmp_path / "engine" / "newcomer.py").write_text('"""A module the listing does not name."""\n')
    assert modules_in_the_tree(root) - modules_in_the_architecture(text) == {"engine/newcomer.py"}


def long_script_functions(root: str = ROOT, limit: int = 90) -> list[str]:
    """The scripts' functions of ``limit`` lines or more: a script's loop reads on a screen and a half, and what
    the project adds to it (chunks, the OOM back-off, exact resume, the watchdog) is one named call each."""
    found = []
    for name in SCRIPTS:
        tree = ast.parse(open(os.path.join(root, f"{name}.py")).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length >= limit:
                    found.append(f"{name}.py:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_script_function_is_90_lines_or_longer(tmp_path):
    assert long_script_functions() == []
    root = copy_of_the_tree(tmp_path)
    (tmp_path / "eval.py").write_text("def long():\n" + "    pass\n" * 89)
    assert long_script_functions(root) == ["eval.py:1 long: 90 lines"]
