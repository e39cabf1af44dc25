"""The tree is the architecture: every project module's imports (module- and function-level, read with ast) go
down the layer order below or stay in their layer, never form a cycle, and never reach a script. The layer order
is written here, once; the README's Layers section draws it."""
from __future__ import annotations

import ast
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. A module may import its own layer and those below; packages of one layer do not import each other.
LAYERS = [
    ("core",),                 # files and atomic writes, errors, runtime, logging, the command-line edge
    ("config",),               # the schema, presets, validation, the flag table
    ("datasets", "models"),    # data in, models out
    ("artifacts",),            # the run directory, checkpoints, CSV logs, plots, the cron ledger
    ("engine",),               # chunking, the step and OOM back-off, the loop, evaluation, streaming inference
    ("planner",),              # the memory planner (runs the engine's step)
]
SCRIPTS = {"train", "eval", "infer_chunked"}  # and every package's __main__: entry points, imported by nothing
SKIP = {".venv", "tests", "bench", "data", "runs", ".git"}


def project_modules(root: str = ROOT) -> dict[str, str]:
    """module name -> file, for the scripts and every package module."""
    modules = {}
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        if rel != "." and rel.split(os.sep)[0] in SKIP | {d for d in rel.split(os.sep) if d.startswith(".")}:
            dirs[:] = []
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            parts = [] if rel == "." else rel.split(os.sep)
            stem = name[:-3]
            if stem != "__init__":
                parts.append(stem)
            if parts:
                modules[".".join(parts)] = os.path.join(folder, name)
    return {m: f for m, f in modules.items() if "." in m or m in SCRIPTS or os.path.basename(f) == "__init__.py"}


def imports_of(path: str, module: str, known: set[str]) -> list[tuple[str, int, bool, str]]:
    """(imported project module, line, whether inside a function, the source line) for each import."""
    source = open(path).read()
    lines = source.splitlines()
    tree = ast.parse(source)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + ([base] if base
                                                                                                        else []))
                names = [base] + [f"{base}.{alias.name}" for alias in child.names]
            for name in names:
                target = resolve(name)
                if target is not None and target != module:
                    found.append((target, child.lineno, inside, lines[child.lineno - 1]))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and inside:
                found.append(("<function-level>", child.lineno, True, lines[child.lineno - 1]))
            visit(child, inside)

    visit(tree, False)
    return found


def layer_of(module: str) -> int | None:
    top = module.split(".")[0]
    if module in SCRIPTS or module.endswith("__main__"):
        return None
    return next(i for i, names in enumerate(LAYERS) if top in names)


def violations(root: str = ROOT) -> list[str]:
    modules = project_modules(root)
    known = set(modules)
    problems, graph = [], {}
    for module, path in sorted(modules.items()):
        graph[module] = set()
        for target, line, _, text in imports_of(path, module, known):
            where = f"{os.path.relpath(path, root)}:{line}"
            if target == "<function-level>":
                if "#" not in text:
                    problems.append(f"{where}: a function-level import without its reason: {text.strip()}")
                continue
            graph[module].add(target)
            if target in SCRIPTS or target.endswith("__main__"):
                problems.append(f"{where}: {module} imports the script {target}")
                continue
            mine, theirs = layer_of(module), layer_of(target)
            if mine is None:
                continue  # scripts may import any layer
            if theirs > mine:
                problems.append(f"{where}: {module} (layer {mine}: {'/'.join(LAYERS[mine])}) imports {target} "
                                f"(layer {theirs}: {'/'.join(LAYERS[theirs])}), a higher layer")
            elif theirs == mine and target.split(".")[0] != module.split(".")[0]:
                problems.append(f"{where}: {module} imports {target}, another package of its layer")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected part of more than one module (or a module importing itself)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part) + [sorted(part)[0]])

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_imports_follow_the_layers_without_cycles_or_scripts():
    assert violations() == []


def test_every_package_module_has_a_layer():
    for module in project_modules():
        if module not in SCRIPTS and not module.endswith("__main__"):
            assert layer_of(module) is not None, module


@pytest.mark.parametrize("change, expected", [
    ("core/files.py", "import cycle"),               # core.files <-> core.errors
    ("config/__init__.py", "a higher layer"),        # config imports the engine
    ("engine/watch.py", "without its reason"),       # a lazy import with no word on why
    ("engine/loop.py", "imports the script train"),  # a library module importing a script
])
def test_the_check_fails_on_a_cycle_an_upward_import_and_a_script_import(tmp_path, change, expected):
    for name in ("core", "config", "engine", "datasets", "models", "artifacts", "planner"):
        shutil.copytree(os.path.join(ROOT, name), tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    for script in SCRIPTS:
        shutil.copy(os.path.join(ROOT, f"{script}.py"), tmp_path)
    assert violations(str(tmp_path)) == []
    extra = {"core/files.py": "from core import errors\n", "config/__init__.py": "import engine.loop\n",
             "engine/loop.py": "import train\n", "engine/watch.py": "def later():\n    import json\n"}[change]
    (tmp_path / change).write_text(extra + (tmp_path / change).read_text())
    if change == "core/files.py":
        errors = tmp_path / "core" / "errors.py"
        errors.write_text("import core.files\n" + errors.read_text())
    problems = violations(str(tmp_path))
    assert any(expected in p for p in problems), problems
