"""Every command of the README works as printed after the README's install. The README's bash blocks are read line by
line and run in order in one empty folder, as a newcomer runs them: each script in-process through its main(argv),
with tiny-size flags appended (a later flag wins), on the test dataset. A line fails, named, when its command is
unknown, a flag does not exist, the script refuses, it needs a package that neither the README's install line nor
the line itself installs, or an output it names (`-> PATH` in its comment, a --plot or --json file) or a metric it
quotes is missing. Install commands are not run: what they name must exist (a requirements file, a pinned package).
A `python -c "..."` line of the README or docs/ runs as printed, in a process of its own; CHANGELOG.md names the
homes the names have now."""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from common import UserError

ROOT = Path(__file__).resolve().parents[1]

# The flags a README command of each script gets appended: tiny sizes, the test dataset (--data_root={data}: its
# "shakespeare" is 4 plays), the CPU. A script the README runs that is not here fails: say how to shrink it.
TINY = {
    "train.py": ["--data_root={data}", "--block_size=32", "--max_iters=2", "--eval_interval=2", "--eval_batches=1",
                 "--log_interval=1", "--device=cpu"],
    "finetune.py": ["--data_root={data}"],  # the rest is its checkpoint's run's
    "generate.py": ["--max_new_tokens=8", "--device=cpu"],
    "eval.py": ["--data_root={data}", "--max_batches=2", "--device=cpu"],
    "results.py": [],
}
# Commands the suite does not run, and why
NOT_RUN = {("python", "-m", "pytest"): "the test suite itself (CI runs it: .ci/run)"}
RUNNER = {"pytest-xdist"}  # the test runner's own package: never hidden from it, and no script imports it


def requirement_names(path: Path) -> set[str]:
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return {canonicalize_name(Requirement(line).name) for line in lines if line}


def bash_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each command line of the text's ```bash blocks, in order; comment lines left out."""
    lines, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            inside = line == "```bash"
        elif inside and shlex.split(line, comments=True):
            lines.append((number, line))
    return lines


def commands(line: str) -> list[list[str]]:
    """A line's commands, as the shell splits them: words, comments dropped, at each &&."""
    words = shlex.split(line, comments=True)
    out = [[]]
    for word in words:
        if word == "&&":
            out.append([])
        else:
            out[-1].append(word)
    return out


def installed_by(pip: list[str], where: str) -> set[str]:
    """The packages a `pip install ...` command installs (canonical names); each named package must be pinned in
    requirements.lock (a name this project knows), each -r file must exist."""
    assert pip[:2] == ["pip", "install"], f"{where}: only `pip install` is known, not {' '.join(pip)}"
    names, words = set(), iter(pip[2:])
    pinned = requirement_names(ROOT / "requirements.lock")
    for word in words:
        if word in ("-r", "--requirement"):
            path = ROOT / next(words)
            assert path.is_file(), f"{where}: {path.name} does not exist"
            names |= requirement_names(path)
        elif word in ("--index-url", "--extra-index-url", "-i", "--find-links", "-f"):
            next(words)
        elif not word.startswith("-"):
            name = canonicalize_name(Requirement(word).name)
            assert name in pinned, f"{where}: pip install {word}: not a package of requirements.lock"
            names.add(name)
    return names


@functools.cache
def modules_of() -> dict[str, set[str]]:
    """The top-level modules each installed distribution provides, by its canonical name."""
    provided: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provided.setdefault(canonicalize_name(dist), set()).add(module)
    return provided


def import_names(distributions: set[str]) -> set[str]:
    """The top-level modules these distributions provide, where installed."""
    return {module for dist in distributions for module in modules_of().get(dist, ())}


def hide(modules: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Make these packages absent for the rest of the monkeypatch's life: importing one fails, find_spec is None."""
    for name in modules:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")] or [name]:
            monkeypatch.setitem(sys.modules, key, None)


def run_script(words: list[str], where: str, data: Path, capsys: pytest.CaptureFixture) -> str:
    """`python SCRIPT.py ARGS` in-process with its tiny flags; what it printed (stdout and stderr)."""
    script = words[1] if len(words) > 1 else ""
    assert script in TINY, (f"{where}: unknown command {' '.join(words[:2])} (a script of this repository with "
                            "tiny settings in tests/test_readme.py's TINY, or a command in NOT_RUN)")
    argv = words[2:] + [flag.format(data=data) for flag in TINY[script]]
    if any(word.startswith("--stop_at=") for word in words):  # a planned stop within TINY's 2 steps
        argv.append("--stop_at=1")
    capsys.readouterr()
    try:
        importlib.import_module(script.removesuffix(".py")).main(argv)
    except UserError as e:
        pytest.fail(f"{where}: {script} refuses: {e}")
    except SystemExit as e:
        assert e.code in (0, None), f"{where}: {script} exits {e.code}"
    printed = capsys.readouterr()
    return printed.out + printed.err


def check_outputs(line: str, words: list[str], printed: str, where: str) -> None:
    """What the line says it gives: each `-> PATH` of its comment and --plot / --json file exists; each metric its
    comment quotes (`val_ce 6.50`) is printed."""
    comment = line.partition(" #")[2]
    files = re.findall(r"-> (\S+)", comment)
    files += [w.partition("=")[2] for w in words if w.startswith(("--plot=", "--json="))]
    for path in files:
        assert Path(path).is_file(), f"{where}: no {path} was written"
    for metric in re.findall(r"\b(val_\w+) \d", comment):
        assert metric in printed, f"{where}: {metric} is not printed"


def run_readme(text: str, data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Run every command line of the text's bash blocks in the current folder. The first line is the install: what
    its pip commands install is there for every line; a line's own pip commands add to it for that line."""
    every = requirement_names(ROOT / "requirements.txt") | requirement_names(ROOT / "requirements-dev.txt")
    install = None
    for number, line in bash_lines(text):
        where = f"README.md:{number}: `{line.partition(' #')[0].strip()}`"
        own = set().union(*(installed_by(words, where) for words in commands(line) if words[0] == "pip"))
        install = own if install is None else install
        for words in commands(line):
            if words[0] == "pip" or tuple(words[:3]) in NOT_RUN:
                continue
            assert words[0] == "python", f"{where}: unknown command {words[0]}"
            with monkeypatch.context() as patch:
                hide(import_names(every - install - own - RUNNER), patch)
                printed = run_script(words, where, data, capsys)
            check_outputs(line, words, printed, where)


@pytest.mark.usefixtures("small_tiny_preset")
def test_every_readme_command_works_as_printed(tiny_data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_readme((ROOT / "README.md").read_text(), tiny_data_dir.parent, monkeypatch, capsys)
    assert (tmp_path / "out" / "curves.png").is_file() and not list(tmp_path.glob("*.png"))  # under a run folder


INSTALL = "pip install torch && pip install -r requirements.txt"
BROKEN = [  # a README line after the install line, and what its failure says
    ("frobnicate --x=1", "README.md:3: `frobnicate --x=1`: unknown command frobnicate"),
    ("python nothere.py", "unknown command python nothere.py"),
    ("python train.py --no_such_flag=1", "train.py refuses: unknown setting --no_such_flag"),
    ("python results.py --log=out/log.jsonl --plot=out/c.png", "--plot needs matplotlib"),  # not installed
    ("pip install nothere && python train.py", "pip install nothere: not a package of requirements.lock"),
    ("pip install -r requirements-gpu.txt", "requirements-gpu.txt does not exist"),
    ("python generate.py --help  # -> out/sample.txt", "no out/sample.txt was written"),
]


@pytest.mark.parametrize("line, message", BROKEN, ids=[line for line, _ in BROKEN])
def test_a_readme_line_that_does_not_work_fails_naming_it(line, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((AssertionError, pytest.fail.Exception)) as e:
        run_readme(f"```bash\n{INSTALL}\n{line}\n```\n", tmp_path, monkeypatch, capsys)
    assert f"README.md:3: `{line.partition(' #')[0].strip()}`" in str(e.value) and message in str(e.value), e.value


def test_the_readme_starts_with_a_run_and_ci_s_test_command_and_stays_short():
    text = (ROOT / "README.md").read_text()
    first = text[text.index("```bash\n") + 8:]
    first = first[:first.index("```")].splitlines()
    assert len(first) == 2 and first[0].endswith("&& python train.py"), first
    ci = re.search(r'"\$python" (-m pytest .*)', (ROOT / ".ci" / "run").read_text()).group(1)
    assert first[1].endswith(f"&& python {ci}") and "pip install -r requirements.lock" in first[1], (first[1], ci)
    assert len(text.encode()) <= 16 * 1024


def test_the_readme_and_hacking_md_give_one_reading_order():
    readme = re.findall(r"^\| \d+ \| `(\w+\.py)` \|", (ROOT / "README.md").read_text(), re.M)
    hacking = (ROOT / "docs" / "hacking.md").read_text()
    sentence = re.search(r"the learner's path: (.*?); then this page", re.sub(r"\s+", " ", hacking))
    assert sentence and re.findall(r"`(\w+\.py)`", sentence.group(1)) == readme


def test_every_python_c_line_of_the_docs_runs_as_printed():
    """docs/training.md's `python -c "import doors, train; print(cli.settings_table(...))"` failed (NameError: cli):
    each such line of the README and docs/ runs from the repository's folder, exits 0 and prints."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    lines = [(page.name, line) for page in pages for line in re.findall(r'`(python -c "[^"`]+")`', page.read_text())]
    assert lines  # training.md's settings table
    for page, line in lines:
        done = subprocess.run([sys.executable, *shlex.split(line)[1:]], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0 and done.stdout, (page, line, done.stderr[-2000:])


def top_level_names(path: Path) -> set[str]:
    """What a file defines or imports at its top level: the names `module.NAME` finds."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def test_the_changelog_names_the_homes_names_have_now():
    """Issue 55: its rows sent `common.parse_given` and `peak_flops` to files that no longer hold them. In each row
    of "Names that moved", every `module.NAME` of its "now" cell is there, and the names of a row whose "now" cell
    starts with a file are in that file."""
    modules = {path.stem for path in ROOT.glob("*.py")}
    table = (ROOT / "CHANGELOG.md").read_text().split("## Names that moved")[1].split("\n## ")[0]
    wrong = []
    for row in [line for line in table.splitlines() if line.startswith("| `")]:
        names, _, now = (cell.strip() for cell in row.strip("|").split(" | "))
        for module, name in re.findall(r"`[^`]*?\b(\w+)\.(\w+)", now):
            if module in modules and name != "py" and name not in top_level_names(ROOT / f"{module}.py"):
                wrong.append(f"{module}.{name}")
        home, bare = re.match(r"`([\w/]+\.py)`", now), re.findall(r"`([^`]+)`", names)
        if home and all(name.isidentifier() for name in bare):
            wrong += [f"{name} in {home[1]}" for name in bare if name not in top_level_names(ROOT / home[1])]
    assert wrong == []
