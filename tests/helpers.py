"""Helpers shared by test files. It imports the core only (common, train), so a fork that deletes an extra and
its test files keeps every other test file collecting (tests/test_style.py checks it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import common
from train import TrainConfig


def tiny_config(data_dir, out_dir, **overrides) -> TrainConfig:
    """A 30-step run of the (shrunk) tiny preset on the test dataset, validated every 10 steps, on CPU."""
    settings = dict(dataset=str(data_dir), preset="tiny", block_size=32, batch_size=8, max_iters=30,
                    warmup_iters=5, eval_interval=10, eval_batches=2, log_interval=1, out_dir=str(out_dir),
                    device="cpu", seed=0)
    return TrainConfig(**{**settings, **overrides})


def read_log(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too), by relative path: equal snapshots, nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(main, argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """What `python SCRIPT.py ARGV` does when it fails: (exit code, stdout, the last line of stderr)."""
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        common.run_main(main)
    out, err = capsys.readouterr()
    return e.value.code, out, (err.splitlines() or [""])[-1]


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
