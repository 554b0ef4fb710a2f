"""The core's shape, checked mechanically: one statement a line, train() in one screen, no import circle,
the line budgets of the design card, and the README's tables of line counts as the files are."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEARNERS_PATH = ("train", "finetune", "generate", "model", "loss", "data")
PLUMBING = ("common", "doors")
CORE = LEARNERS_PATH + PLUMBING


def core_files() -> dict[str, Path]:
    return {name: ROOT / f"{name}.py" for name in CORE if (ROOT / f"{name}.py").is_file()}


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines())


def one_statement_problems(source: str) -> list[str]:
    """Lines that hold more than one statement, or one statement over several lines by backslash."""
    problems = []
    strings = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.OP and tok.string == ";":
            problems.append(f"{tok.start[0]}: ';'")
        if tok.type == tokenize.STRING:
            strings.append((tok.start, tok.end))
    for number, line in enumerate(source.splitlines(), 1):
        end = (number, len(line.rstrip()) - 1)
        inside_string = any(start <= end < stop for start, stop in strings)
        if line.rstrip().endswith("\\") and not inside_string:
            problems.append(f"{number}: backslash continuation")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Lambda):
            problems.append(f"{node.lineno}: assigned lambda")
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and \
                isinstance(node.value, ast.Tuple):
            problems.append(f"{node.lineno}: several values assigned at once")
        compound = (ast.If, ast.For, ast.While, ast.With, ast.FunctionDef, ast.ClassDef)
        if isinstance(node, compound) and node.body[0].lineno == node.lineno:
            problems.append(f"{node.lineno}: a body on the line of its header")
    return problems


@pytest.mark.parametrize("name", CORE)
def test_the_core_has_one_statement_a_line(name):
    path = ROOT / f"{name}.py"
    if not path.is_file():
        pytest.skip(f"{name}.py is not in this checkout")
    assert one_statement_problems(path.read_text()) == []


@pytest.mark.parametrize("source, problem", [
    ("a = 1; b = 2\n", "';'"), ("x = 1 + \\\n    2\n", "backslash"), ("f = lambda x: x\n", "lambda"),
    ("a, b = f(1), g(2)\n", "several values"), ("if a: b()\n", "body on the line"),
])
def test_the_checker_finds_each_kind_of_packed_line(source, problem):
    assert any(problem in p for p in one_statement_problems(source))


@pytest.mark.parametrize("source", ["B, T = x.shape\n", "loss, acc = step(x)\n", 's = "a \\\\\\n b"\n',
                                    "x = (1 +\n     2)\n"])
def test_the_checker_lets_one_value_unpack(source):
    assert one_statement_problems(source) == []


def test_train_reads_in_one_screen():
    tree = ast.parse((ROOT / "train.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 80
    nested = [n for n in ast.walk(train) if n is not train and isinstance(n, (ast.FunctionDef, ast.Lambda))]
    assert nested == []


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_import_circle_in_the_core_and_train_never_imports_finetune():
    files = core_files()
    graph = {name: imports_of(path) & set(files) for name, path in files.items()}
    assert "finetune" not in graph["train"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])
    assert [name for name in graph if reaches(name, name, set())] == []


def test_the_core_fits_the_design_cards_budget():
    files = core_files()
    learners = {name: lines_of(files[name]) for name in LEARNERS_PATH}
    plumbing = {name: lines_of(files[name]) for name in PLUMBING if name in files}
    assert sum(learners.values()) <= 1750 and learners["train"] <= 650, learners
    assert all(n <= 400 for name, n in learners.items() if name != "train"), learners
    assert sum(plumbing.values()) <= 900 and all(n <= 450 for n in plumbing.values()), plumbing


def test_the_readmes_line_counts_are_the_files():
    rows = re.findall(r"^\| (?:\d+ \| )?`(\w+\.py)` \| (\d[\d,]*) \|", (ROOT / "README.md").read_text(), re.M)
    assert len(rows) >= 15
    wrong = {name: (int(n.replace(",", "")), lines_of(ROOT / name)) for name, n in rows
             if (ROOT / name).is_file() and int(n.replace(",", "")) != lines_of(ROOT / name)}
    assert wrong == {}, "README says (lines, but the file has): " + str(wrong)
