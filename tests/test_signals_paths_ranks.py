"""Signals, streams, paths and ranks (docs/failures.md): a signal at any moment, imports included, ends a command
in one line with 130 or 143; a closed or full stdout, or a terminal's encoding, is named as such; errors name
their cause (an explicit chain only; out of memory names the setting to lower). Each class is a seeded table or
a Hypothesis generator; the cases the fault probe named (issue 42) are rows."""
from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import read_log, refusal, run_cli, tiny_config, without_timing
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file

import checkpoint
import common
import eval as eval_script
import generate
import prepare
import run_folder
import safe_files
import tokenizer
import train

pytestmark = pytest.mark.usefixtures("small_tiny_preset")

ROOT = Path(__file__).resolve().parents[1]
STOP_LINE = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}
SMALL_MODEL = ["--preset=tiny", "--n_layer=1", "--n_head=2", "--d_model=32", "--block_size=32"]


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir, tmp_path_factory):
    """A finished one-step run of the shrunk tiny preset: its checkpoint is what generate.py reads."""
    import model

    out = tmp_path_factory.mktemp("run") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(model.PRESETS, "tiny", dict(n_layer=1, n_head=2, d_model=32, block_size=32))
        train.train(tiny_config(tiny_data_dir, out, max_iters=1, eval_interval=1, batch_size=2, block_size=16))
    return out


def start(argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env or ENV, stdout=kwargs.pop("stdout",
                            subprocess.PIPE), stderr=subprocess.PIPE, text=True, **kwargs)


def ckpt_of(run_dir: Path) -> str:
    return str(run_folder.run_files(run_dir)[0])


# ----------------------------------------------------------------------------------------------
# Contract 4: a signal at any moment, imports included


def commands(run_dir: Path, data_dir: Path, tmp: Path) -> dict[str, list[str]]:
    """Commands that run for longer than the latest signal: it always finds them at work."""
    return {
        "generate": ["generate.py", f"--ckpt={ckpt_of(run_dir)}", "--prompt=ROMEO", "--max_new_tokens=100000",
                     "--device=cpu"],
        "train": ["train.py", f"--dataset={data_dir}", *SMALL_MODEL, "--batch_size=2", "--max_iters=100000",
                  "--eval_interval=100000", "--eval_batches=1", f"--out_dir={tmp / 'train'}", "--device=cpu"],
        "finetune": ["finetune.py", f"--ckpt={ckpt_of(run_dir)}", f"--dataset={data_dir}", "--max_iters=100000",
                     "--eval_interval=100000", f"--out_dir={tmp / 'finetune'}", "--device=cpu"],
    }


def signal_table(seed: int, rows: int) -> list[tuple[str, signal.Signals, float]]:
    """(command, signal, delay) rows drawn from a seed: delays from the script's first line (its imports) to
    seconds into the work."""
    rng = random.Random(seed)
    names = ["generate", "train", "finetune"]
    return [(names[i % 3], rng.choice([signal.SIGINT, signal.SIGTERM]), round(rng.uniform(0.0, 4.0), 2))
            for i in range(rows)]


SIGNAL_ROWS = [  # the probe's cases: SIGINT in the first second (imports); generate.py stopped by each signal
    ("generate", signal.SIGINT, 0.05), ("train", signal.SIGTERM, 0.05), ("generate", signal.SIGTERM, 5.0),
    ("generate", signal.SIGINT, 5.0), *signal_table(42, 3)]


def script_started(proc: subprocess.Popen, timeout: float = 60) -> float:
    """When the script's first line has run (it catches SIGTERM from then on: /proc's SigCgt): before it, the
    interpreter starts up (tenths of a second on a busy machine) as Python's, which no script can change."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if caught >> (signal.SIGTERM - 1) & 1:
            return time.monotonic()
        time.sleep(0.005)
    raise AssertionError(f"{proc.args} never installed its signal handlers")


def test_a_signal_at_any_moment_ends_every_command_in_one_line(run_dir, tiny_data_dir, tmp_path):
    """Every row's process is started at once (the imports cost seconds each) and signalled its delay after its
    script's first line: it exits 128 + the signal, and its last line of stderr says so; no traceback, whatever
    it was doing (importing torch, loading, training, saving, generating)."""
    procs = []
    for i, (name, signum, delay) in enumerate(SIGNAL_ROWS):
        argv = commands(run_dir, tiny_data_dir, tmp_path / str(i))[name]
        procs.append([name, signum, delay, delay, start(argv, stdout=subprocess.DEVNULL)])
    for row in procs:
        row[3] += script_started(row[4])
    for _, signum, _, at, proc in sorted(procs, key=lambda p: p[3]):
        time.sleep(max(0.0, at - time.monotonic()))
        proc.send_signal(signum)
    for name, signum, delay, _, proc in procs:
        _, err = proc.communicate(timeout=120)
        row = (name, signum.name, delay)
        assert proc.returncode == 128 + signum, (row, proc.returncode, err[-2000:])
        assert err.splitlines()[-1] == STOP_LINE[signum] and "Traceback" not in err, (row, err[-2000:])


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM),
                                           (signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGINT)],
                         ids=lambda s: s.name)
def test_a_second_signal_during_a_save_waits_for_it_and_exits_with_its_own_code(first, second, tiny_data_dir,
                                                                                tmp_path, monkeypatch, capsys):
    """The probe's case: two SIGTERMs during a save exited 130 (a KeyboardInterrupt), not 143."""
    real_log, real_deferred = train.append_log, common.StopFlag.deferred

    def first_signal_at_step_2(out_dir, record):
        real_log(out_dir, record)
        if record["step"] == 2 and "loss" in record:
            signal.raise_signal(first)

    @contextlib.contextmanager
    def second_signal_mid_save(self):
        with real_deferred(self):
            signal.raise_signal(second)
            yield

    monkeypatch.setattr(train, "append_log", first_signal_at_step_2)
    monkeypatch.setattr(common.StopFlag, "deferred", second_signal_mid_save)
    cfg = tiny_config(tiny_data_dir, tmp_path / "o", max_iters=4, eval_interval=10, batch_size=2)
    code, _, last = run_cli(lambda argv: train.train(cfg), [], monkeypatch, capsys)
    assert (code, last) == (128 + second, STOP_LINE[second])
    assert checkpoint.last_good_checkpoint(run_folder.run_files(tmp_path / "o")[0]).endswith("(step 2)")


# ----------------------------------------------------------------------------------------------
# Contract 4: the output stream


def closed_pipe() -> int:
    """The write end of a pipe whose reader is gone (`| head -1` once head has its line)."""
    read, write = os.pipe()
    os.close(read)
    return write


STREAM_ROWS = {  # (stdout, environment, exit code, what the last line of stderr says)
    "closed pipe (| head -1)": ("pipe", {}, 0, None),
    "closed (>&-)": ("closed", {}, 2, "cannot write the output to stdout: it is closed"),
    "full device (> /dev/full)": ("/dev/full", {}, 2, "cannot write the output to stdout (No space left on device)"),
    "terminal without the character": (os.devnull, {"PYTHONIOENCODING": "ascii"}, 2, "the terminal's encoding"),
}
STREAM_CASES = [(row, script) for row in STREAM_ROWS for script in ("generate", "train --help")
                if (row, script) != ("terminal without the character", "train --help")]  # --help is ASCII


@pytest.mark.parametrize("row, script", STREAM_CASES)
def test_a_closed_or_full_stdout_ends_quietly_or_in_one_line(row, script, run_dir):
    """Never a traceback, never "the checkpoint is damaged" (generate.py blamed the checkpoint for a character
    the terminal could not show)."""
    where, env, code, words = STREAM_ROWS[row]
    argv = (["train.py", "--help"] if script == "train --help" else
            ["generate.py", f"--ckpt={ckpt_of(run_dir)}", "--prompt=café ROMEO", "--max_new_tokens=20",
             "--device=cpu"])
    if where == "closed":  # the shell's `>&-`: Python starts with no sys.stdout (an AttributeError before)
        proc = start_redirected(argv, ">&-")
    else:
        stdout = closed_pipe() if where == "pipe" else open(where, "w")
        try:
            proc = start(argv, env={**ENV, **env}, stdout=stdout)
        finally:
            os.close(stdout) if isinstance(stdout, int) else stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code and "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    if words:
        last = err.splitlines()[-1]
        assert last.startswith("error: ") and words in last and "checkpoint" not in last, err[-2000:]
    else:
        assert "error" not in err, err


def start_redirected(argv: list[str], redirect: str) -> subprocess.Popen:
    """`python ARGV REDIRECT` in a shell: the standard stream as the shell leaves it (`>&-` closes it)."""
    return subprocess.Popen(["sh", "-c", f'exec "$0" "$@" {redirect}', sys.executable, *argv], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stream_run(argv: list[str], redirect: str) -> tuple[int, str, str]:
    proc = start_redirected(argv, redirect)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def run_record(out_dir: Path) -> tuple[list[dict], dict]:
    """A finished run's log (less its timing) and its checkpoint's tensors: what a run that could not print keeps."""
    return without_timing(read_log(out_dir)), load_file(run_folder.run_files(out_dir)[0])


STDERR_ROWS = {  # the redirection: a stream the run cannot print to, or the stdout it never writes
    "stderr full (2>/dev/full)": "2>/dev/full", "stderr closed (2>&-)": "2>&-", "stdout closed (>&-)": ">&-"}


@pytest.fixture(scope="module")
def straight_run(tiny_data_dir, tmp_path_factory) -> tuple[list[str], tuple]:
    """A short train.py whose stderr is read: the argv (less its out_dir) and its record."""
    argv = ["train.py", f"--dataset={tiny_data_dir}", *SMALL_MODEL, "--batch_size=2", "--max_iters=4",
            "--warmup_iters=1", "--eval_interval=2", "--eval_batches=1", "--device=cpu"]
    out = tmp_path_factory.mktemp("straight") / "run"
    code, _, err = stream_run([*argv, f"--out_dir={out}"], "")
    assert code == 0 and "done: 4 steps" in err, err[-2000:]
    return argv, run_record(out)


@pytest.mark.parametrize("row", STDERR_ROWS)
def test_a_run_that_cannot_print_keeps_its_log_and_checkpoint_true(row, straight_run, tmp_path):
    """Issue 55: `train.py 2>/dev/full` and `>&-` were tracebacks (exit 1; the first before step 0), and with `2>&-` the
    notes went to stdout. Now the notes are dropped, the run goes on: exit 0, nothing on stdout, and its log and
    checkpoint's tensors those of the run whose stderr was read."""
    argv, (log, tensors) = straight_run
    code, out, err = stream_run([*argv, f"--out_dir={tmp_path / 'run'}"], STDERR_ROWS[row])
    assert (code, out) == (0, ""), (code, out[-2000:], err[-2000:])
    assert "Traceback" not in err
    kept_log, kept_tensors = run_record(tmp_path / "run")
    assert kept_log == log and kept_tensors.keys() == tensors.keys()
    assert all(torch.equal(kept_tensors[k], tensors[k]) for k in tensors)


def test_generate_with_a_full_stderr_still_writes_its_text(run_dir):
    code, out, _ = stream_run(["generate.py", f"--ckpt={ckpt_of(run_dir)}", "--prompt=ROMEO", "--max_new_tokens=5",
                               "--device=cpu"], "2>/dev/full")
    assert code == 0 and out.startswith("ROMEO") and out.endswith("\n"), (code, out)


# ----------------------------------------------------------------------------------------------
# Contract 9: errors name their cause


def chain(links: list[tuple[str, str]]) -> BaseException:
    """An exception raised at the end of a chain of (kind, link) pairs, the first raised first: each next one
    raised `from` the one before ("cause") or while handling it ("context")."""
    kinds = {"oserror": lambda: OSError(errno.ENOSPC, "No space left on device"), "value": lambda: ValueError("x"),
             "interrupt": lambda: KeyboardInterrupt(), "term": lambda: common.Interrupted(signal.SIGTERM)}
    before = None
    for kind, link in links:
        e = kinds[kind]()
        if before is not None:
            if link == "cause":
                e.__cause__ = before
            e.__context__ = before
        before = e
    return before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["oserror", "value", "interrupt", "term"]),
                          st.sampled_from(["cause", "context"])), min_size=1, max_size=4))
def test_the_error_writer_follows_an_explicit_chain_only(links):
    e = chain(links)
    caused = e
    while caused is not None and not isinstance(caused, OSError):
        caused = caused.__cause__
    found = safe_files.write_error(e, Path("/nonexistent/f"), "file")
    if caused is None or not isinstance(e, Exception):
        assert found is e  # a signal (or any error) raised while an OSError was handled is itself; a signal, always
    else:
        assert isinstance(found, common.UserError) and "no space left on device while saving" in str(found)


def test_a_signal_while_the_built_in_dataset_is_prepared_is_a_stop(tmp_path, monkeypatch, capsys):
    """The probe's case: Ctrl-C while train.py prepares the built-in dataset (an error raised while handling the
    missing meta.json's error) was "cannot write ... while saving", exit 2."""
    real = tokenizer.encode_batches

    def ctrl_c_while_encoding(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare, "encode_batches", ctrl_c_while_encoding)
    argv = [f"--data_root={tmp_path / 'data'}", f"--out_dir={tmp_path / 'o'}", "--max_iters=1", "--device=cpu"]
    assert run_cli(train.main, argv, monkeypatch, capsys)[::2] == (130, "interrupted")
    assert not (tmp_path / "data" / "shakespeare").exists()


def out_of_memory(kind: str):
    def raising(*args, **kwargs):
        if kind == "torch":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if kind == "cpu":
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
        raise MemoryError()
    return raising


OOM_ROWS = [  # (script, where memory runs out, how, the setting the line names)
    ("train", (train.Run, "step"), "torch", "--batch_size"), ("train", (train.Run, "validate"), "cpu", "--batch_size"),
    ("generate", (generate, "generate"), "python", "--max_new_tokens"),
    ("eval", (eval_script, "evaluate"), "torch", "--batch_size")]


@pytest.mark.parametrize("script, where, how, setting", OOM_ROWS, ids=lambda v: v if isinstance(v, str) else "")
def test_out_of_memory_is_one_line_naming_the_setting_to_lower(script, where, how, setting, run_dir, tiny_data_dir,
                                                               tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(*where, out_of_memory(how))
    ckpt = ckpt_of(run_dir)
    argv = {"train": [f"--dataset={tiny_data_dir}", f"--out_dir={tmp_path / 'o'}", "--max_iters=2",
                      "--batch_size=2", "--device=cpu"],
            "generate": [f"--ckpt={ckpt}", "--prompt=ROMEO", "--max_new_tokens=3", "--device=cpu"],
            "eval": [f"--ckpt={ckpt}", "--task=val", f"--dataset={tiny_data_dir}", "--max_batches=1",
                     "--device=cpu"]}[script]
    main = {"train": train.main, "generate": generate.main, "eval": eval_script.main}[script]
    code, _, last = run_cli(main, argv, monkeypatch, capsys)
    assert code == 2 and last.startswith("error: out of memory (") and setting in last, last


# ----------------------------------------------------------------------------------------------
# Also: a prompt file saved on Windows


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1).map(str.strip)
                .filter(bool), min_size=1, max_size=4), st.sampled_from(["\n", "\r\n"]))
def test_a_prompt_file_is_its_prompts_whatever_its_line_ends(tmp_path_factory, prompts, end):
    """The probe's case: CRLF prompt files were one prompt (their blank lines are "\\r\\n\\r\\n")."""
    path = tmp_path_factory.mktemp("prompts") / "p.txt"
    path.write_bytes((end * 2).join(prompts).encode() + end.encode())
    assert generate.read_prompts(generate.GenerateConfig(prompt_file=str(path))) == prompts


@pytest.mark.parametrize("name, make", [
    ("log.jsonl", lambda p: os.mkfifo(p)),
    ("ckpt.safetensors", lambda p: p.symlink_to(p.parent / "gone")),
    ("log.jsonl", lambda p: p.symlink_to(p.parent / "gone")),
])
@pytest.mark.parametrize("flag", ["", "--overwrite"])
def test_a_run_file_that_is_a_link_or_a_special_file_is_refused_and_left(tiny_data_dir, tmp_path, monkeypatch,
                                                                           capsys, name, make, flag):
    """Issue 42, contract 5: a FIFO named log.jsonl or a dangling link named ckpt.safetensors is never written
    through, replaced or deleted, --overwrite or not."""
    out = tmp_path / "out"
    out.mkdir()
    make(out / name)
    argv = [f"--dataset={tiny_data_dir}", f"--out_dir={out}", "--max_iters=1", "--device=cpu", *filter(None, [flag])]
    err = refusal(train.main, argv, monkeypatch, capsys)  # exit 2, one line
    assert f"{out / name} is a link, a folder or a special file" in err, err
    assert sorted(p.name for p in out.iterdir()) == [name] and os.path.lexists(out / name)
    assert (out / name).is_symlink() or (out / name).is_fifo()


def test_a_path_that_is_not_utf8_is_refused_before_any_work(tiny_data_dir, tmp_path, monkeypatch, capsys):
    """Issue 42, contract 5: an --out_dir of bytes that are no UTF-8 (as argv keeps them) would be written, and no
    command could name it again: refused in one line, nothing made."""
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/out-\xff")
    err = refusal(train.main, [f"--dataset={tiny_data_dir}", f"--out_dir={out}", "--device=cpu"], monkeypatch, capsys)
    assert "is not UTF-8 text" in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("script, flag", [
    ("train", "--out_dir=~/r"), ("train", "--init_from=~/run/ckpt.safetensors"), ("data", "--dataset=~/corpus"),
    ("generate", "--ckpt=~user/ckpt.safetensors"), ("train", "--data_root=~/d"), ("data", "--data_root=~/d")])
def test_a_path_starting_with_a_tilde_means_one_thing_everywhere(script, flag, tmp_path, monkeypatch, capsys):
    """Issue 42, contract 5: `--out_dir=~/r` was checked as $HOME/r and written as ./~/r (a fine-tune replaced its
    own input). ~ is expanded nowhere: such a path is refused in one line naming the fix, before any work."""
    monkeypatch.chdir(tmp_path)
    main = {"train": train.main, "data": prepare.main, "generate": generate.main}[script]
    err = refusal(main, [flag, "--prompt=a"] if script == "generate" else [flag], monkeypatch, capsys)
    assert "a path starting with ~ is not expanded here" in err and "$HOME" in err, err
    if "--data_root" in flag:  # the flag given, not the dataset folder made from it (--dataset=~/d/shakespeare)
        assert err.startswith(f"error: {flag}: "), err
    assert os.listdir(tmp_path) == []


def test_a_signal_something_swallowed_still_ends_the_command(monkeypatch, capsys):
    """A Ctrl-C raised inside what Python ignores (an import lock's callback: "Exception ignored in ...") was lost, and
    generate.py ran to its end with exit 0 (seen in the signal table under load): the handler remembers it, the
    generation loop raises it again, and run_main ends with its code whatever swallowed it."""
    def swallowing_main(argv):
        with contextlib.suppress(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)  # run_main's handler in a test process too (SIGINT: pytest's)
        print("went on")

    monkeypatch.setattr(sys, "argv", ["script.py"])
    with pytest.raises(SystemExit) as e:
        common.run_main(swallowing_main)
    assert e.value.code == 143 and capsys.readouterr().err.splitlines()[-1] == "terminated"
