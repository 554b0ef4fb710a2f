"""One owner at a time (issue 42, docs/failures.md "One owner at a time", contracts A to D): a run folder and a
dataset have one owner by one mechanism (safe_files.hold_lock), a run knows its data, a replacement is a unit whatever
kills it, and files are read within their bounds, offline in seconds.

kill -9 is real: a forked copy of this process runs the command and SIGKILLs itself at its k-th step on the file
system (a rename, an exchange, an unlink, a folder removed, a log line appended), for every k of a seeded table;
no `finally` runs, as under the kernel's kill. The next command then continues exactly or refuses in one line,
and no earlier dataset or run is lost."""
from __future__ import annotations

import fcntl
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import read_log, run_cli, snapshot
from hypothesis import given, settings, strategies as st

import checkpoint
import data
import finetune
import prepare
import run_folder
import safe_files
import train
from common import UserError

pytestmark = pytest.mark.usefixtures("small_tiny_preset")
ROOT = Path(__file__).resolve().parents[1]
STEPS = [(safe_files.os, "rename"), (safe_files.os, "replace"), (safe_files.os, "unlink"),
         (safe_files.shutil, "rmtree"), (safe_files, "exchange"), (run_folder, "append_log"),
         (train, "append_log")]  # where a command changes what is on disk


def killed_at(k: int, command, *, two_renames: bool = False) -> int | str:
    """Run command() in a forked child that SIGKILLs itself at its k-th file-system step (STEPS): -1 when it was
    killed; else the number of steps it took (k beyond them), or the one line it refused with. `two_renames`: a
    file system without renameat2's exchange."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        torch.set_num_threads(1)  # no thread pool inherited across the fork
        count = [0]
        said = b"error"
        try:
            for owner, name in STEPS:
                real = getattr(owner, name, None)
                if real is None:
                    continue

                def step(*args, _real=real, **kwargs):
                    count[0] += 1
                    if count[0] == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return _real(*args, **kwargs)

                setattr(owner, name, step)
            if two_renames and hasattr(safe_files, "exchange"):
                safe_files.exchange = lambda a, b: False
            with open(os.devnull, "w") as quiet:
                os.dup2(quiet.fileno(), 2)
                command()
            said = str(count[0]).encode()
        except UserError as e:
            said = f"error: {e}".encode()
        finally:
            os.write(write, said)
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        said = f.read()
    if os.WIFSIGNALED(status):
        return -1
    return int(said) if said.isdigit() else said


def corpus(folder: Path, words: str) -> Path:
    """A two-document corpus (its own validation file): a dataset in a fraction of a second."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text(f"the {words} quick brown fox jumps over the lazy dog.\n" * 40)
    (folder / "validation.txt").write_text(f"a lazy {words} dog sleeps in the sun.\n" * 10)
    return folder


def prepared(root: Path, source: Path) -> prepare.PrepareConfig:
    return prepare.PrepareConfig(dataset=str(source), data_root=str(root), name="books")


def checksums(folder: Path) -> dict | None:
    """The dataset in `folder`, whole (through its door), as its shards' checksums; None if there is none."""
    try:
        return data.load_meta(folder)["checksums"]
    except UserError:
        return None


# ------------------------------------------------------------------ 1. one owner per dataset, by one mechanism


def test_two_data_py_on_one_dataset_at_once_exactly_one_proceeds(tmp_path, monkeypatch, capsys):
    """A data.py in the middle of preparing a dataset (another process, holding it) and a second one started at
    seeded moments after it: the second is refused in one line naming it, the folder untouched; the lock file stays
    (never unlinked: no one removes the lock another holds); kill -9 of the holder releases it for the next."""
    source = corpus(tmp_path / "corpus", "old")
    root = tmp_path / "d"
    argv = [f"--dataset={source}", f"--data_root={root}", "--name=books"]
    prepare.main(argv)
    before = snapshot(root / "books")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), "books"], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for offset in sorted(random.Random(42).uniform(0, 0.2) for _ in range(4)):
            time.sleep(offset)
            code, _, err = run_cli(prepare.main, argv, monkeypatch, capsys)
            assert code == 2 and err.startswith(f"error: {root / 'books'} is in use by another prepare.py preparing it "
                                                f"(pid {holder.pid}") and "\n" not in err.strip(), err
            assert snapshot(root / "books") == before and (root / ".books.lock").exists()
    finally:
        holder.kill()  # kill -9 of the holder: the kernel releases its lock
        holder.wait(timeout=30)
    prepare.main(argv)  # the killed holder left no stale lock: the next one proceeds
    assert checksums(root / "books") is not None
    assert sorted(p.name for p in root.iterdir()) == [".books.lock", "books"]


HOLDER = """
import sys, time
from pathlib import Path
import prepare
with prepare.hold_dataset(Path(sys.argv[1]) / sys.argv[2]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_releasing_a_dataset_never_removes_the_lock_another_holds(tmp_path):
    """The named case: a dataset's lock file was removed by name after the folder swap, so one data.py releasing
    its lock deleted the one another held. The lock file is beside the folder (the swap never moves it) and is
    never unlinked: held by one, a second is refused, before and after any swap."""
    root = tmp_path / "d"
    prepare.prepare(prepared(root, corpus(tmp_path / "old", "old")))
    with prepare.hold_dataset(root / "books"):
        with pytest.raises(UserError, match="is in use by another prepare.py preparing it"):
            prepare.prepare(prepared(root, corpus(tmp_path / "old", "old")))
        assert safe_files.lock_holder(root, ".books.lock") is not None
    prepare.prepare(prepared(root, corpus(tmp_path / "old", "old")))  # released: the next one proceeds
    with prepare.hold_dataset(root / "books"):  # the same lock file, after the swap
        assert f"pid {os.getpid()}" in safe_files.lock_holder(root, ".books.lock")


def test_a_lock_file_goes_only_with_the_folder_its_command_made(tmp_path):
    """A command refused in a folder it made leaves no folder: its lock file is removed with it, still held; a
    command that opened that file just before (between its open and its flock) finds it is no longer the file at
    the name, and takes the new one. A lock file in a folder that was there stays."""
    out = tmp_path / "new" / "run"
    with pytest.raises(UserError, match="refused"), safe_files.hold_lock(out, "train.py run"):
        early = os.open(out / ".lock", os.O_RDONLY)  # another command, between its open and its flock
        raise UserError("refused")
    assert not (tmp_path / "new").exists()
    try:
        fcntl.flock(early, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it locks a file no name leads to: not the lock
        assert not safe_files.still_at(early, out / ".lock")
        with safe_files.hold_lock(out, "train.py run"):
            assert f"pid {os.getpid()}" in safe_files.lock_holder(out)  # the new file at the name is the lock
    finally:
        os.close(early)
    out.mkdir(parents=True)
    with pytest.raises(UserError, match="refused"), safe_files.hold_lock(out, "train.py run"):
        raise UserError("refused")
    assert (out / ".lock").exists()  # a folder that was there: its lock file stays


# -------------------------------------------------- 3. a dataset is swapped so one of the two is always in place


@pytest.mark.parametrize("two_renames", [False, True], ids=["exchange", "two-renames"])
def test_kill_9_of_data_py_at_every_step_loses_no_dataset(two_renames, tmp_path):
    """kill -9 at each step of preparing a dataset again (seeded order): at that moment the earlier dataset or the
    new one is in place, whole, or set aside for the next start (a file system without an exchange, killed
    between its two renames); the next data.py finishes, and a reader finds the earlier one back."""
    root, source = tmp_path / "d", tmp_path / "corpus"
    prepare.prepare(prepared(root, corpus(source, "old")))
    old = checksums(root / "books")
    corpus(source, "new")  # the same source, edited: prepared again under its name
    steps = killed_at(10**6, lambda: prepare.prepare(prepared(root, source)), two_renames=two_renames)
    new = checksums(root / "books")
    assert steps >= 2 and new != old, steps
    for k in random.Random(7).sample(range(1, steps + 1), steps):
        shutil.rmtree(root)
        prepare.prepare(prepared(root, corpus(source, "old")))
        corpus(source, "new")
        assert killed_at(k, lambda: prepare.prepare(prepared(root, source)), two_renames=two_renames) == -1
        found = checksums(root / "books")
        aside = safe_files.set_aside(root / "books") if hasattr(safe_files, "set_aside") else []
        assert found in (old, new) or (found is None and [checksums(p) for p in aside] == [old]), k
        prepare.ensure_dataset(str(root / "books"), str(root))  # a reader: what a killed swap left, put back
        assert checksums(root / "books") in (old, new), k
        prepare.prepare(prepared(root, source))  # the next start finishes
        assert checksums(root / "books") == new
        assert sorted(p.name for p in root.iterdir()) == [".books.lock", "books"], k  # no temp, nothing aside


# ----------------------------------------------------------------------------- 2. a run knows its data


@pytest.fixture
def run_on_books(tmp_path):
    """A 2-step run on a dataset `books` (its checkpoint records the shards' checksums)."""
    root = tmp_path / "d"
    prepare.prepare(prepared(root, corpus(tmp_path / "old", "old")))
    flags = [f"--dataset={root / 'books'}", "--preset=tiny", "--block_size=16", "--batch_size=2", "--max_iters=2",
             "--eval_interval=2", "--eval_batches=1", "--device=cpu", f"--out_dir={tmp_path / 'o'}", "--seed=0"]
    train.main(flags)
    return root, flags


@pytest.mark.parametrize("command, again", [("--resume", "other"), ("--resume=auto", "other"), ("finetune", "other"),
                                            ("--resume", "same"), ("finetune", "same")])
def test_a_run_goes_on_only_on_its_own_data(command, again, run_on_books, tmp_path, monkeypatch, capsys):
    """The named case: a dataset prepared again under the same name between a run's stop and its --resume: the run
    went on silently with other shards than the checksums its checkpoint recorded. Refused in one line (prepare
    it under another name, or --overwrite); the same data prepared again goes on."""
    root, flags = run_on_books
    prepare.prepare(prepared(root, corpus(tmp_path / "old", "old" if again == "same" else "new")))
    before = snapshot(tmp_path / "o")
    if command == "finetune":
        argv = [f"--ckpt={tmp_path / 'o' / 'ckpt.safetensors'}", f"--data_root={root}", f"--out_dir={tmp_path / 'ft'}",
                "--max_iters=1", "--eval_interval=1", "--eval_batches=1"]
        main = finetune.main
    else:
        argv, main = [*flags, command, "--max_iters=3"], train.main
    if again == "same":
        main(argv)
        return
    code, _, err = run_cli(main, argv, monkeypatch, capsys)
    assert code == 2 and "books was prepared again since (its shards differ from the checksums the checkpoint " \
                          "recorded)" in err and "prepare.py --name=NAME), or start over with --overwrite" in err, err
    assert snapshot(tmp_path / "o") == before
    if command != "finetune":
        train.main([*flags, "--overwrite"])  # a new run on the new data


# ---------------------------------------------------------- 3. a run's checkpoint and log are replaced as a unit


def test_kill_9_of_train_py_overwrite_at_every_step_never_pairs_two_runs(run_on_books, tmp_path, monkeypatch,
                                                                         capsys):
    """The named case: `--overwrite --seed=1` killed before its first save left the old run's checkpoint beside
    the new run's log, and --resume=auto went on with both. At every step of a seeded table, what is left is one
    run's pair (or a log alone, which a new run replaces), and --resume=auto continues it or refuses in one
    line."""
    _, flags = run_on_books
    out = tmp_path / "o"
    first = tmp_path / "first"
    shutil.copytree(out, first)
    replace = [*flags, "--overwrite", "--seed=1", "--max_iters=4"]
    steps = killed_at(10**6, lambda: train.main(replace))
    assert steps >= 4
    for k in random.Random(3).sample(range(1, steps + 1), min(steps, 6)):
        shutil.rmtree(out)
        shutil.copytree(first, out)
        assert killed_at(k, lambda: train.main(replace)) == -1
        assert_one_runs_pair(out)
        after = killed_at(10**6, lambda: train.main([*flags, "--resume=auto", "--max_iters=4"]))
        assert isinstance(after, int) or after.startswith("error: ") and "\n" not in after, (k, after)
        assert_one_runs_pair(out)


def assert_one_runs_pair(out: Path) -> None:
    """A checkpoint and a log in out_dir are one run's: the log holds the validation its checkpoint was saved
    after (a save follows one), and the same run id."""
    ckpt, log = run_folder.run_files(out)
    if not (ckpt.exists() and log.exists()):
        return
    saved = checkpoint.load_checkpoint(ckpt, train.TrainConfig)
    records = read_log(out)
    assert any(r["step"] == saved.state.step and "val_ce" in r for r in records), (saved.state.step, records)
    assert {r.get("run_id") for r in records} == {saved.run_id}


def test_resume_refuses_a_checkpoint_and_a_log_of_two_runs(run_on_books, tmp_path, monkeypatch, capsys):
    _, flags = run_on_books
    other = tmp_path / "other"
    train.main([*flags, f"--out_dir={other}", "--seed=1"])
    shutil.copy(other / "log.jsonl", tmp_path / "o" / "log.jsonl")
    before = snapshot(tmp_path / "o")
    for resume in ("--resume", "--resume=auto"):
        code, _, err = run_cli(train.main, [*flags, resume, "--max_iters=3"], monkeypatch, capsys)
        assert code == 2 and err.startswith(f"error: {tmp_path / 'o' / 'log.jsonl'} is the log of another run "
                                            "(run_id ") and "start over with --overwrite" in err, err
        assert snapshot(tmp_path / "o") == before


# --------------------------------------------------------------------------- 6. bounded and quick offline


@pytest.mark.parametrize("kind, size, sparse, words", [
    (".txt", 3 << 30, True, "is a sparse file"),  # the named case: 3 GB of holes, read whole (MemoryError)
    (".jsonl", 3 << 30, True, "is a sparse file"),
    (".parquet", 3 << 30, True, "is a sparse file"),
    (".txt", 5000, False, "read whole as one document"),  # beyond the bound (made 4,000 bytes here)
    (".json", 5000, False, "read whole as one JSON value"),
    (".jsonl", 5000, False, "has a line of more than"),
])
def test_every_corpus_file_is_read_within_the_bound_of_its_kind(kind, size, sparse, words, tmp_path, monkeypatch,
                                                                capsys):
    import corpora
    monkeypatch.setattr(corpora, "MAX_DOCUMENT_BYTES", 4000, raising=False)
    monkeypatch.setattr(corpora, "SCAN_BYTES", 1000, raising=False)  # a line across reads
    path = tmp_path / f"big{kind}"
    with open(path, "wb") as f:
        f.truncate(size) if sparse else f.write(b'{"text": "' + b"x" * size + b'"}\n')
    started = time.monotonic()
    code, _, err = run_cli(prepare.main, [f"--dataset={path}", f"--data_root={tmp_path / 'd'}"], monkeypatch, capsys)
    assert code == 2 and words in err and time.monotonic() - started < 30, err


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 17))
def test_the_longest_line_is_measured_in_bounded_reads(lengths, scan):
    """corpora.longest_line, read `scan` bytes at a time (a line across reads), against a plain split."""
    import corpora
    text = b"\n".join(b"x" * n for n in lengths)
    saved = corpora.SCAN_BYTES
    corpora.SCAN_BYTES = scan
    try:
        assert corpora.longest_line(io.BytesIO(text)) == max(lengths)
    finally:
        corpora.SCAN_BYTES = saved


HUB_COMMANDS = {  # every way a command reaches the hub: what it loads, named in its one line
    "prepare.py --dataset=ORG/NAME": (lambda t: prepare.main(["--dataset=someone/corpus", f"--data_root={t}"]),
                                      "dataset 'someone/corpus'"),
    "prepare.py --tokenizer=hf:ORG/NAME": (lambda t: prepare.main([f"--dataset={corpus(t / 'c', 'old')}",
                                                                   f"--data_root={t}",
                                                                   "--tokenizer=hf:someone/tokenizer"]),
                                           "the tokenizer of 'someone/tokenizer'"),
    "eval.py (LAMBADA)": (lambda t: __import__("eval").load_lambada(None), "EleutherAI/lambada_openai"),
    "glue.py": (lambda t: __import__("glue").load_split(__import__("glue").GlueConfig(), "train"), "nyu-mll/glue"),
    "xnli.py": (lambda t: list(__import__("xnli").hub_split("en", "test")), "facebook/xnli/en test"),
    "hf.py import": (lambda t: __import__("hf")._download("someone/model"), "someone/model"),
}


@pytest.mark.parametrize("command", HUB_COMMANDS)
def test_every_hub_name_offline_fails_in_seconds(command, tmp_path, monkeypatch):
    """Without network (and without HF_HUB_OFFLINE), each way to the hub is one line in seconds, naming what it
    would load and how to go on; the libraries retried for minutes."""
    load, what = HUB_COMMANDS[command]
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # a name no DNS resolves: offline
    started = time.monotonic()
    with pytest.raises(UserError) as e:
        load(tmp_path)
    assert time.monotonic() - started < 15
    message = str(e.value)
    assert message.startswith("cannot reach the Hugging Face hub (https://hub.invalid) to load ") and what in message
    assert "HF_HUB_OFFLINE=1" in message and "\n" not in message, message


def test_a_hub_name_offline_fails_in_seconds_with_one_line(tmp_path):
    """The named case: `data.py --dataset=ORG/NAME` without network waited 2 minutes before its one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                                                                    "all_proxy"))}
    env["HF_ENDPOINT"] = "https://hub.invalid"  # a name no DNS resolves: offline
    started = time.monotonic()
    result = subprocess.run([sys.executable, "data.py", "--dataset=someone/corpus", f"--data_root={tmp_path}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and time.monotonic() - started < 20
    assert result.stderr.strip() == ("error: cannot reach the Hugging Face hub (https://hub.invalid) to load "
                                     "dataset 'someone/corpus': check the network, or pass a local path, or set "
                                     "HF_HUB_OFFLINE=1 to read it from your Hugging Face cache")
