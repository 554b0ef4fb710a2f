"""The architecture that protects users and forks: no import loop (lazy imports included), plumbing beneath the rest,
the core never imports an extra at module level, and deleting the extras (with the test files that import them)
leaves a core that runs and a suite that collects. Sizes are never checked here: a fork that adds lines keeps a
green suite. Style is ruff's (pyproject.toml; its E7 rules keep one statement a line)."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("train", "finetune", "generate", "model", "loss", "data", "checkpoint", "load", "prepare", "sources",
        "tokenizer", "common", "doors", "cli", "devices", "ddp", "safe_files", "io_checks",
        "run_folder")
PLUMBING = ("common", "doors", "cli", "devices", "ddp", "safe_files", "io_checks", "run_folder")


def modules() -> dict[str, Path]:
    return {p.stem: p for p in ROOT.glob("*.py")}


def imports_of(path: Path, top_level_only: bool = False) -> set[str]:
    """Every module a file imports: at the top (and under a top-level if/try), or anywhere (inside functions too);
    `from . import x` counts as importing x."""
    tree = ast.parse(path.read_text())
    nodes = list(ast.walk(tree))
    if top_level_only:  # a function's body is left out; a top-level `if` or `try` runs at import
        nodes = []
        for node in tree.body:
            nodes += list(ast.walk(node)) if isinstance(node, (ast.If, ast.Try)) else [node]
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
        if isinstance(node, ast.ImportFrom) and not node.module:
            names |= {a.name for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """Which project files each project file imports, at any depth (lazy imports included), from the source."""
    files = modules()
    return {name: (imports_of(path) & set(files)) - {name} for name, path in files.items()}


def import_cycles(graph: dict[str, set[str]], limit: int = 20) -> list[list[str]]:
    """The import loops of a graph, each as its files in order from its first name (at most `limit` of them)."""
    found: list[list[str]] = []

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == path[0]:
                found.append([*path, nxt])
            elif nxt > path[0] and nxt not in path and len(found) < limit:
                walk([*path, nxt])
    for start in sorted(graph):
        walk([start])
    return found[:limit]


def test_no_import_loop_lazy_imports_included_and_train_never_imports_finetune():
    graph = import_graph()
    assert "finetune" not in graph["train"]
    assert [" -> ".join(f"{name}.py" for name in cycle) for cycle in import_cycles(graph)] == []


def test_import_cycles_finds_and_names_a_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_plumbing_imports_nothing_above_it():
    graph = import_graph()
    above = {name: sorted(found - set(PLUMBING))
             for name, found in graph.items() if name in PLUMBING}
    assert {name: found for name, found in above.items() if found} == {}
    assert "common" not in graph["doors"]  # common reads its files through doors


def test_the_core_imports_an_extra_only_inside_the_function_that_serves_it():
    extras = set(modules()) - set(CORE)
    at_top = {name: sorted(imports_of(modules()[name], top_level_only=True) & extras) for name in CORE}
    assert {name: found for name, found in at_top.items() if found} == {}


def test_test_helpers_import_the_core_only():
    extras = set(modules()) - set(CORE)
    for shared in ("conftest.py", "helpers.py"):
        assert imports_of(ROOT / "tests" / shared) & extras == set(), shared


def test_deleting_the_extras_and_their_tests_leaves_a_core_that_runs_and_a_suite_that_collects(tmp_path):
    """A fork keeps the core: every extra deleted, with each test file that imports one, the other test files
    still collect (shared helpers live in tests/helpers.py, never in an extra's test file), and a training run
    starts and ends."""
    copy = tmp_path / "core"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "data", "out*", "__pycache__", ".*cache"))
    extras = set(modules()) - set(CORE)
    for name in extras:
        (copy / f"{name}.py").unlink()
    tests = {p.stem: p for p in (copy / "tests").glob("*.py")}
    for path in tests.values():  # an extra's own tests: those that import it
        if imports_of(path) & extras:
            path.unlink()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "tests"], cwd=copy, capture_output=True, text=True, env=env, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    summary = collected.stdout.strip().splitlines()[-1]
    assert "test_train.py" in collected.stdout and "error" not in summary, summary
    flags = ["--preset=tiny", "--block_size=16", "--batch_size=2", "--max_iters=2", "--eval_interval=2",
             "--eval_batches=1", "--device=cpu", f"--data_root={copy / 'data'}", f"--out_dir={copy / 'out'}"]
    run = subprocess.run([sys.executable, "train.py", *flags], cwd=copy, capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0 and "done: 2 steps" in run.stderr, run.stderr[-3000:]
    missing = subprocess.run([sys.executable, "train.py", *flags, "--loss_chunk_size=8", "--overwrite"], cwd=copy,
                             capture_output=True, text=True, env=env, timeout=300)
    assert missing.returncode == 2
    assert missing.stderr.strip() == ("error: --loss_chunk_size needs chunked.py, which is not in this checkout; "
                                      "restore it or drop --loss_chunk_size")


def test_the_forks_check_names_test_files_that_exist():
    """`pytest -m core` (conftest.CORE, the README's check in a minute) names files of tests/: a renamed one would
    leave the check without a word (a renamed test of a file it names is an error at collection)."""
    import conftest
    missing = [entry for entry in conftest.CORE if not (ROOT / "tests" / entry.partition("::")[0]).is_file()]
    assert not missing, f"conftest.CORE names files that are not in tests/: {missing}; update CORE"
