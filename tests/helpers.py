"""Helpers shared by test files. It imports the core only (common, train), so a fork that deletes an extra and
its test files keeps every other test file collecting (tests/test_style.py checks it)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import common
from plan import QUICK
from train import TrainConfig


def tiny_config(data_dir, out_dir, **overrides) -> TrainConfig:
    """`python train.py --quick`'s run (plan.QUICK: 30 steps of the tiny preset, shrunk by conftest's
    small_tiny_preset, validated every 10) on the test dataset, on CPU."""
    settings = dict(**QUICK, dataset=str(data_dir), out_dir=str(out_dir), device="cpu", seed=0)
    return TrainConfig(**{**settings, **overrides})



class Delete:
    """The marker of a field to delete, with a stable name: test ids must be the same in every process."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE = Delete()

def read_log(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "run_id")} for r in records]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too), by relative path: equal snapshots, nothing changed. A released
    lock file (empty: safe_files.hold_lock unlinks it only with a folder it made) holds nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not (p.name.endswith(".lock") and p.stat().st_size == 0)}


def run_cli(main, argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """What `python SCRIPT.py ARGV` does when it fails: (exit code, stdout, the last line of stderr)."""
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        common.run_main(main)
    out, err = capsys.readouterr()
    return e.value.code, out, (err.splitlines() or [""])[-1]


def refusal(main, argv: list[str], monkeypatch, capsys) -> str:
    """`python SCRIPT.py ARGV` is refused as a user sees it: exit code 2, nothing on stdout, and its error one
    line, the last on stderr (after any progress notes; no traceback, no second `error:` line); returns it."""
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        common.run_main(main)
    out, err = capsys.readouterr()
    assert (e.value.code, out) == (2, ""), (e.value.code, out, err)
    return one_error_line(err)


def one_error_line(err: str) -> str:
    """The one error line that ends a refused command's stderr."""
    lines = err.split("\n")
    assert err.endswith("\n") and lines[-2].startswith("error: "), err[-2000:]
    assert [line for line in lines if line.startswith(("error", "Traceback"))] == [lines[-2]], err[-2000:]
    return lines[-2]


# (input, output) path pairs: every way an output can be, hold or lie inside an input (contract 1)

RELATIONS = ("same", "inside", "holds", "link", "link_parent", "hardlink")


def released_lock(path: Path) -> bool:
    """A lock file safe_files.hold_lock left (empty: the next holder's lock is the same file)."""
    return path.name.startswith(".") and path.name.endswith(".lock") and not path.is_symlink() and path.is_file() \
        and path.stat().st_size == 0


def tree_state(root: Path) -> dict[str, object]:
    """Every entry under root, links unfollowed: a folder, a link's target, a file's bytes (a file of more than
    1 MiB, a sparse one: its size, inode and modification time), so that equal states mean nothing changed."""
    state = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if released_lock(path):
                continue
            info = path.lstat()
            state[str(path.relative_to(root))] = (
                f"-> {os.readlink(path)}" if path.is_symlink() else "folder" if path.is_dir() else
                (info.st_size, info.st_ino, info.st_mtime_ns) if info.st_size > 1 << 20 else path.read_bytes())
    return state


FILE_KINDS = {"file": "", "jsonl": ".jsonl", "config": ".json", "tokenizer": ".json"}  # kind: its name's suffix


def make_input(path: Path, kind: str) -> None:
    """An input of a kind a script reads: a file, a JSON config, a jsonl, a folder (a dataset's, a corpus, an HF
    model's). Its content does not matter: the command must refuse before reading it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind in FILE_KINDS:
        path.write_text({"file": "bytes", "jsonl": '{"text": "a b"}\n', "config": "{}\n", "tokenizer": "{}"}[kind])
        return
    path.mkdir()
    inside = {"dataset": "meta.json", "corpus": "a.txt", "hf": "config.json", "folder": "notes.txt"}[kind]
    (path / inside).write_text("{}\n")


def written_path(relation: str, source: Path, root: Path, name: str, spelling: int) -> str:
    """The path a command would write (named `name`), standing in `relation` to the input `source`, as a user
    could spell it: absolute, relative to the current folder (root), or through `sub/..`."""
    if relation == "same":
        target = source
    elif relation == "inside":
        target = source / "sub" / name
    elif relation == "holds":
        target = source.parent
    elif relation == "link":
        target = root / "links" / name
        target.parent.mkdir(exist_ok=True)
        target.symlink_to(source)
    elif relation == "link_parent":
        link = root / "links" / "to-parent"
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(source.parent)
        target = link / source.name
    else:  # hardlink
        target = root / "hard" / name
        target.parent.mkdir(exist_ok=True)
        os.link(source, target)
    text = str(target)
    if spelling == 1:
        text = os.path.relpath(target, root)
    elif spelling == 2:
        text = str(target.parent / "sub" / ".." / target.name)
    return text


def io_pairs(specs: dict, max_examples: int = 12):
    """A Hypothesis test over (input, output) pairs of every script in `specs` (name -> (main, the input's kind, the
    relations that apply, the name of what it writes, argv(input, output path))): each is refused in one line,
    exit code 2, and nothing under the working folder changes (a tree_state before and after)."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    @settings(max_examples=max_examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(script=st.sampled_from(sorted(specs)), relation=st.sampled_from(RELATIONS),
           spelling=st.integers(0, 2), depth=st.integers(0, 2))
    def check(tmp_path_factory, monkeypatch, capsys, script, relation, spelling, depth):
        main, kind, relations, name, argv = specs[script]
        if relation not in relations:
            relation = relations[0]
        root = tmp_path_factory.mktemp("io")
        monkeypatch.chdir(root)
        suffix = FILE_KINDS.get(kind, "")
        source = root.joinpath(*["deep"] * depth, "input" + suffix if relation in ("inside", "link") else name)
        if relation == "holds":
            source = root / name / f"input{suffix}"
        make_input(source, kind)
        target = written_path(relation, source, root, name, spelling)
        before = tree_state(root)
        code, out, err = run_cli(main, argv(str(source), target), monkeypatch, capsys)
        assert code == 2 and out == "" and err.startswith("error: "), (script, relation, code, out, err)
        assert "Traceback" not in err and tree_state(root) == before, (script, relation, err)

    return check


# Damage to a JSON file: a value of another type, a field deleted, the text cut short

WRONG_JSON = ["text", [], {}, None, -1, 1e309, True, 2**70]  # 1e309: JSON's Infinity


def json_paths(value, prefix: tuple = ()):
    """Every path (of keys and indices) in a JSON value, the value's own (()) first."""
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from json_paths(item, (*prefix, key))


def damaged_json(good, how: str, where: float, wrong) -> str:
    """`good` as JSON text, damaged: "retype" sets the value at the `where`-th share of its paths to `wrong`,
    "delete" deletes it, "cut" cuts the text at that share of its length."""
    import copy

    text = json.dumps(good)
    if how == "cut":
        return text[:int(where * len(text))]
    paths = list(json_paths(good))[1:]
    key_path = paths[int(where * len(paths))]
    damaged = copy.deepcopy(good)
    parent = damaged
    for key in key_path[:-1]:
        parent = parent[key]
    if how == "retype":
        parent[key_path[-1]] = wrong
    else:
        del parent[key_path[-1]]
    return json.dumps(damaged)


# A command run as a user runs it, in a process of its own whose address space may grow by a bounded amount only
# (RLIMIT_AS over what the imports took): an input that makes a command allocate more fails there (a MemoryError or
# a refused allocation, with its traceback), a segfault ends that process alone, and a hang is cut by a timeout.
# One process serves many commands (torch is imported once); a crashed or hung one is replaced.

WORKER = r"""
import contextlib, importlib, io, json, os, resource, sys, time, traceback
sys.path.insert(0, sys.argv[1])
import common
for name in sys.argv[3:]:
    importlib.import_module(name)
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_AS)[1]))
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    out, err, code = io.StringIO(), io.StringIO(), 0
    start = time.perf_counter()
    os.chdir(job["cwd"])
    sys.argv = [job["script"] + ".py", *job["argv"]]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            common.run_main(importlib.import_module(job["script"]).main)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except BaseException:  # what Python prints, and its exit code, for an uncaught error
            traceback.print_exc()
            code = 1
    print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                      "seconds": time.perf_counter() - start}), flush=True)
"""


class Worker:
    """Runs `python SCRIPT.py ARGV` in a memory-bounded process (see WORKER); `run` returns
    {"code", "out", "err", "seconds"}, code -N for a process ended by signal N and "hung" past the timeout."""

    def __init__(self, scripts: tuple[str, ...], extra_bytes: int = 1 << 30, root: Path | None = None):
        self.scripts = scripts
        self.extra_bytes = extra_bytes
        self.root = root or Path(__file__).resolve().parents[1]  # another checkout's, to compare
        self.proc = None

    def start(self) -> None:
        import os
        import subprocess
        import tempfile
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        self.log = tempfile.TemporaryFile()  # what the process writes below Python (a library's own stderr)
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(self.root), str(self.extra_bytes),
                                      *self.scripts],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        assert self.proc.stdout.readline() == "ready\n", "the worker did not start"

    def run(self, script: str, argv: list[str], cwd: Path, timeout: float = 60) -> dict:
        import select
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(json.dumps({"script": script, "argv": [str(a) for a in argv], "cwd": str(cwd)}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else None
        if line:
            return json.loads(line)
        self.proc.kill()
        code = self.proc.wait()
        self.proc = None
        return {"code": "hung" if line is None else code, "out": "", "err": "", "seconds": timeout}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.proc = None


def one_line_refusal(result: dict, words: str = "") -> str:
    """A command refused its input as the contract says: exit 2, one `error: ...` line on stderr holding `words`,
    no traceback; returns the line."""
    err = result["err"]
    assert result["code"] == 2 and "Traceback" not in err + result["out"], result
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and err.endswith(lines[0] + "\n") and words in lines[0], result
    return lines[0]


def read_ckpt(path) -> dict:
    """A checkpoint as its door reads it (checkpoint.read_checkpoint: safetensors, its checksum, every field), as the
    table its file holds (doors.plain), for a test to look into or edit and save again (save_ckpt)."""
    import checkpoint
    import doors
    from train import TrainConfig
    return doors.plain(checkpoint.read_checkpoint(path, TrainConfig))


def save_ckpt(payload: dict, path) -> None:
    """Any payload written as a checkpoint file, unchecked (a hostile or damaged one, for its door to refuse).
    Written beside it and renamed, as checkpoint.save_checkpoint does: a payload read from `path` is memory-mapped
    from it, and writing over that file in place would truncate the pages still to be read (SIGBUS).
    A non-finite number is written as JSON's NaN or Infinity token, as a hostile writer may (json.loads reads it),
    where checkpoint.save_checkpoint refuses it."""
    import types

    import checkpoint_format
    real = checkpoint_format.json
    checkpoint_format.json = types.SimpleNamespace(**vars(real))
    checkpoint_format.json.dumps = lambda *args, **kwargs: real.dumps(*args, **{**kwargs, "allow_nan": True})
    tmp = Path(f"{path}.tmp")
    try:
        with open(tmp, "wb") as f:
            for piece in checkpoint_format.checkpoint_bytes(payload):
                f.write(piece)
    finally:
        checkpoint_format.json = real
    os.replace(tmp, path)
