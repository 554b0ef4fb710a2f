"""Faults from issue 21's fault injection, by cause: another run in out_dir, a disk that fails while the
log is appended, a checkpoint that names a data_root, values that do not fit fp32 or JSON, non-finite
weights in generate.py, results files that cannot be written, and JSON nested too deeply to read.

Tests run as root, so read-only folders and full disks are injected (EROFS, EACCES, ENOSPC), never made
with file modes. Every refusal is checked as a user sees it: one line, exit code 2, and nothing changed."""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import pathlib
import shutil
import signal
from pathlib import Path

import pytest
import torch
from helpers import read_ckpt, read_log, run_cli, save_ckpt, snapshot, without_timing

import bench
import cli
import compare
import data
import eval as evaluation
import finetune
import generate
import glue
import plan
import prepare
import results
import run_folder
import safe_files
import train
import xnli
from common import UserError
from model import build_model

pytestmark = pytest.mark.usefixtures("small_tiny_preset")


def train_flags(data_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    """A 4-step tiny run, a checkpoint at steps 2 and 4 (later flags win)."""
    return [f"--dataset={data_dir}", "--preset=tiny", "--block_size=32", "--batch_size=4", "--max_iters=4",
            "--warmup_iters=1", "--eval_interval=2", "--eval_batches=2", "--log_interval=1", f"--out_dir={out_dir}",
            "--device=cpu", "--seed=0", *extra]


@pytest.fixture
def finished(tiny_data_dir, tmp_path_factory, small_tiny_preset) -> Path:
    """The out_dir of a finished 4-step run (`python train.py --max_iters=4 --out_dir=o`): trained once,
    never changed; tests work on copies (see `copy_of`)."""
    out = tmp_path_factory.getbasetemp() / "faults-finished"
    if not (out / "ckpt.safetensors").exists():
        train.main(train_flags(tiny_data_dir, out))
    return out


def copy_of(run: Path, where: Path) -> Path:
    shutil.copytree(run, where)
    return where


REFUSED = ("error: {out} holds another run ({what}); continue it with --resume, start over with --overwrite, "
           "or pick another --out_dir")


# ------------------------------------------------------------- 1. a fresh run never replaces another run


def test_a_fresh_run_into_a_finished_runs_out_dir_is_refused(tiny_data_dir, finished, tmp_path, monkeypatch,
                                                             capsys):
    # python train.py --max_iters=20 --out_dir=o; python train.py --out_dir=o
    out = copy_of(finished, tmp_path / "o")
    before = snapshot(out)
    code, _, err = run_cli(train.main, [f"--dataset={tiny_data_dir}", f"--out_dir={out}", "--device=cpu"],
                           monkeypatch, capsys)
    assert code == 2 and err == REFUSED.format(out=out, what="ckpt.safetensors")
    assert snapshot(out) == before  # ckpt.safetensors and log.jsonl byte-identical, no .lock, no temp file


@pytest.mark.parametrize("during, flags", [("ensure_dataset", ["--resume", "--max_iters=6"]),
                                           ("starting_point", ["--resume", "--max_iters=6"]),
                                           ("claim_out_dir", [])])
def test_ctrl_c_before_a_run_starts_writes_nothing(during, flags, tiny_data_dir, finished, tmp_path, monkeypatch,
                                                  capsys):
    """Ctrl-C while a run claims out_dir (a mistaken one, refused there), or while a resumed one loads its data
    or builds its model: it used to save over the other run's checkpoint at once; now it exits 130 and out_dir
    is as it was (the log is trimmed only once the run is built)."""
    out = copy_of(finished, tmp_path / "o")
    before = snapshot(out)
    module = {"claim_out_dir": run_folder, "ensure_dataset": prepare, "starting_point": plan}[during]  # train()'s
    real = getattr(module, during)

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, during, interrupted)
    code, _, err = run_cli(train.main, [f"--dataset={tiny_data_dir}", f"--out_dir={out}", "--device=cpu", *flags],
                           monkeypatch, capsys)
    assert (code, err) == (130, "interrupted")
    assert snapshot(out) == before


def test_a_refused_run_is_refused_before_anything_is_built(tiny_data_dir, finished, tmp_path, monkeypatch, capsys):
    """Issue 34: a second `python train.py` into out/ was refused only after ~10 s and the model line; the claim
    on out_dir (its checks and lock) now comes first, before the data, the model or the first line."""
    out = copy_of(finished, tmp_path / "o")
    monkeypatch.setattr(prepare, "ensure_dataset", lambda *a: pytest.fail("built before the refusal"))
    code, _, err = run_cli(train.main, [f"--dataset={tiny_data_dir}", f"--out_dir={out}", "--device=cpu"],
                           monkeypatch, capsys)
    assert code == 2 and err == REFUSED.format(out=out, what="ckpt.safetensors")


def test_overwrite_starts_over(tiny_data_dir, finished, tmp_path):
    out = copy_of(finished, tmp_path / "o")
    train.main(train_flags(tiny_data_dir, out, "--overwrite", "--max_iters=2"))
    train.main(train_flags(tiny_data_dir, tmp_path / "fresh", "--max_iters=2"))  # the same run, in a new folder
    assert without_timing(read_log(out)) == without_timing(read_log(tmp_path / "fresh"))  # the old log is gone
    assert read_ckpt(out / "ckpt.safetensors")["state"]["step"] == 2


def test_resume_continues(tiny_data_dir, finished, tmp_path):
    out = copy_of(finished, tmp_path / "o")
    old_log = (out / "log.jsonl").read_bytes()
    train.main(train_flags(tiny_data_dir, out, "--resume", "--max_iters=6"))
    assert read_ckpt(out / "ckpt.safetensors")["state"]["step"] == 6
    assert (out / "log.jsonl").read_bytes().startswith(old_log)
    assert [r["step"] for r in read_log(out)][-3:] == [5, 6, 6]  # steps 5 and 6, then the last validation


@pytest.mark.parametrize("holds, resume, refused", [
    (["ckpt.safetensors"], False, "ckpt.safetensors"),
    (["log.jsonl"], False, "log.jsonl"),  # a run that crashed before its first checkpoint
    (["ckpt.safetensors", "log.jsonl"], False, "ckpt.safetensors"),
    (["log.jsonl"], "auto", None),  # a scheduler's relaunch of that run: it starts (--resume=auto)
    (["notes.txt"], False, None),  # the user's own files are no run
])
def test_what_a_fresh_run_finds_in_out_dir(holds, resume, refused, tiny_data_dir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    for name in holds:
        (out / name).write_bytes(b"the other run's " + name.encode())
    before = snapshot(out)
    cfg = cli.parse_flags(train.TrainConfig, train_flags(tiny_data_dir, out, "--max_iters=1"))
    cfg.resume = resume
    if refused:
        with pytest.raises(UserError) as e:
            train.train(cfg)
        assert f"error: {e.value}" == REFUSED.format(out=out, what=refused)
        assert snapshot(out) == before
    else:
        assert train.train(cfg)["step"] == 1
        assert read_log(out)[0]["step"] == 0  # a log of this run alone
        assert all((out / n).read_bytes() == before[n] for n in holds if n not in ("ckpt.safetensors", "log.jsonl"))


def test_an_out_dir_that_is_a_file(tiny_data_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    out.write_text("a file")
    code, _, err = run_cli(train.main, train_flags(tiny_data_dir, out), monkeypatch, capsys)
    assert code == 2 and err == f"error: --out_dir={out}: it or a folder above it is a file; pass a folder"
    assert out.read_text() == "a file" and sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_finetune_refuses_an_out_dir_holding_another_run(finished, tiny_data_dir, tmp_path, monkeypatch, capsys):
    out = copy_of(finished, tmp_path / "o")
    before = snapshot(out)
    flags = [f"--ckpt={finished / 'ckpt.safetensors'}", f"--out_dir={out}", "--max_iters=1", "--eval_interval=1",
             f"--data_root={tiny_data_dir.parent}"]  # its dataset, looked up by name under --data_root
    code, _, err = run_cli(finetune.main, flags, monkeypatch, capsys)
    assert code == 2 and err == REFUSED.format(out=out, what="ckpt.safetensors")
    assert snapshot(out) == before
    finetune.main([*flags, "--overwrite"])
    tuned = read_ckpt(out / "ckpt.safetensors")
    assert tuned["state"]["step"] == 1 and "lm_head.weight" in tuned["model"]


# ------------------------------------------------------------- 2. the disk fails while log.jsonl is appended


class FailingFile:
    """A file whose next write stores half its text, then fails with `code`, as a disk that fills up (or goes
    read-only) in the middle of a line."""

    def __init__(self, file, code: int):
        self.file, self.code = file, code

    def write(self, text):
        self.file.write(text[:len(text) // 2])
        raise OSError(self.code, os.strerror(self.code))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def fail_log_appends(monkeypatch, after: int, code: int) -> None:
    """The appends to log.jsonl after the first `after` fail with OSError `code`."""
    count = {"n": 0}

    def opener(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if not (str(path).endswith("log.jsonl") and mode == "a"):
            return f
        count["n"] += 1
        return f if count["n"] <= after else FailingFile(f, code)

    monkeypatch.setattr(run_folder, "open", opener, raising=False)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES], ids=errno.errorcode.get)
def test_a_failed_log_append_is_one_line_and_resume_continues(code, tiny_data_dir, finished, tmp_path, monkeypatch,
                                                              capsys):
    out = tmp_path / "o"
    fail_log_appends(monkeypatch, after=4, code=code)  # step 0 val, 1, 2, step 2 val + checkpoint; then step 3
    exit_code, _, err = run_cli(train.main, train_flags(tiny_data_dir, out), monkeypatch, capsys)
    assert exit_code == 2
    assert err == (f"error: cannot append to {out / 'log.jsonl'} ({os.strerror(code)}); free some space or fix the "
                   "folder, then continue with --resume")
    assert read_ckpt(out / "ckpt.safetensors")["state"]["step"] == 2
    assert sorted(p.name for p in out.iterdir()) == [".lock", "ckpt.safetensors", "log.jsonl"]  # no temp file
    if code == errno.ENOSPC:  # space freed: the half line is dropped and the run ends as if never stopped
        monkeypatch.delattr(run_folder, "open")
        train.main(train_flags(tiny_data_dir, out, "--resume"))
        assert without_timing(read_log(out)) == without_timing(read_log(finished))


# ------------------------------------------------------------- 3. where data is read and written: the command line


@pytest.fixture
def recorded_elsewhere(finished, tmp_path) -> tuple[Path, Path]:
    """(a checkpoint of the built-in shakespeare dataset whose train_config.data_root is `elsewhere`,
    `elsewhere`): a folder holding a user's file where that dataset would be prepared."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "shakespeare").mkdir(parents=True)
    (elsewhere / "shakespeare" / "train.bin").write_bytes(b"someone else's data")
    ckpt = read_ckpt(finished / "ckpt.safetensors")
    ckpt["train_config"].update(dataset="shakespeare", data_root=str(elsewhere))
    save_ckpt(ckpt, tmp_path / "ckpt.safetensors")
    return tmp_path / "ckpt.safetensors", elsewhere


@pytest.mark.parametrize("given", ["--data_root", "the default (data)", "an empty --data_root"])
def test_eval_never_reads_or_writes_the_checkpoints_data_root(given, recorded_elsewhere, tiny_data_dir, tmp_path,
                                                               monkeypatch):
    ckpt, elsewhere = recorded_elsewhere
    before = snapshot(elsewhere)
    flags = [f"--ckpt={ckpt}", "--task=val", "--max_batches=1", "--device=cpu"]
    if given == "--data_root":
        flags.append(f"--data_root={tiny_data_dir.parent}")
    elif given == "the default (data)":
        (tmp_path / "cwd").mkdir()
        (tmp_path / "cwd" / "data").symlink_to(tiny_data_dir.parent)
        monkeypatch.chdir(tmp_path / "cwd")
    else:  # the built-in dataset is prepared where the command line says
        flags.append(f"--data_root={tmp_path / 'empty'}")
    result = evaluation.main(flags)
    assert result["dataset"] == "shakespeare" and math.isfinite(result["val_ce"])
    assert snapshot(elsewhere) == before
    if given == "an empty --data_root":
        assert (tmp_path / "empty" / "shakespeare" / "meta.json").is_file()


def test_finetune_never_reads_or_writes_the_checkpoints_data_root(recorded_elsewhere, tiny_data_dir, tmp_path):
    ckpt, elsewhere = recorded_elsewhere
    before = snapshot(elsewhere)
    cfg = finetune.resolve_config([f"--ckpt={ckpt}"])
    assert (cfg.dataset, cfg.data_root) == ("shakespeare", "data")  # the dataset is inherited, never its root
    finetune.main([f"--ckpt={ckpt}", f"--data_root={tiny_data_dir.parent}", f"--out_dir={tmp_path / 'ft'}",
                   "--max_iters=1", "--eval_interval=1"])
    tuned = read_ckpt(tmp_path / "ft" / "ckpt.safetensors")["train_config"]
    assert (tuned["dataset"], tuned["data_root"]) == ("shakespeare", str(tiny_data_dir.parent))
    assert snapshot(elsewhere) == before


# ------------------------------------------------------------- 4. values that do not fit fp32 or JSON


@pytest.mark.parametrize("value, logged", [(math.nan, None), (math.inf, None), (-math.inf, None), (1.5, 1.5)])
def test_the_log_is_always_valid_json(value, logged, tmp_path):
    train.append_log(tmp_path, {"step": 3, "loss": value, "lr": 1e-3})
    line = (tmp_path / "log.jsonl").read_text()

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    assert json.loads(line, parse_constant=no_constants) == {"step": 3, "loss": logged, "lr": 1e-3}


@pytest.mark.parametrize("temperature, message", [
    (1e-40, "--temperature must be in [0.001, 1000], got 1e-40"),
    (5e-4, "--temperature must be in [0.001, 1000], got 0.0005"),
    (1e-3, None), (1e3, None),
    (1001.0, "--temperature must be in [0.001, 1000], got 1001.0"),
    (math.nan, "--temperature must be a finite number, got nan"),
    (math.inf, "--temperature must be a finite number, got inf"),
])
def test_train_temperature_range(temperature, message):
    cfg = train.TrainConfig(temperature=temperature)
    if message is None:
        plan.check_config(cfg)
        return
    with pytest.raises(UserError) as e:
        plan.check_config(cfg)
    assert str(e.value) == message


# ------------------------------------------------------------- 5. generate.py: tiny values, non-finite weights


@pytest.fixture(scope="module")
def gen_ckpts(tmp_path_factory) -> dict[str, str]:
    """A tiny decoder (gpt2 tokens), and copies of it with a NaN or an infinite weight."""
    torch.manual_seed(0)
    m = build_model("tiny", 50304, d_model=32, n_layer=1, n_head=2, block_size=64)
    folder, paths = tmp_path_factory.mktemp("gen"), {}
    for kind, bad in (("good", None), ("nan", math.nan), ("inf", math.inf)):
        state = {k: v.clone() for k, v in m.state_dict().items()}
        if bad is not None:
            state["blocks.0.mlp.up.weight"][0, 0] = bad  # every position's scores go non-finite
        paths[kind] = str(folder / f"{kind}.pt")
        save_ckpt({"model": state, "model_config": dataclasses.asdict(m.config),
                    "data_meta": {"tokenizer": "gpt2", "vocab_size": 50257}, "train_config": {"loss": "ce"}},
                   paths[kind])
    return paths


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token(gen_ckpts, capsys):
    flags = [f"--ckpt={gen_ckpts['good']}", "--prompt=To be", "--max_new_tokens=8", "--device=cpu"]
    generate.main([*flags, "--temperature=0"])
    greedy = capsys.readouterr().out
    generate.main([*flags, "--temperature=0.8", "--top_p=1e-50"])  # was a multinomial traceback
    assert capsys.readouterr().out == greedy
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert {int(generate.sample_token(logits, 1.0, top_p=1e-50)) for _ in range(20)} == {1}


@pytest.mark.parametrize("temperature, refused", [("1e-40", True), ("5e-4", True), ("1e-3", False)])
def test_generate_temperature_near_zero(temperature, refused, gen_ckpts, monkeypatch, capsys):
    flags = [f"--ckpt={gen_ckpts['good']}", "--prompt=To be", "--max_new_tokens=4", "--device=cpu",
             f"--temperature={temperature}"]
    if refused:
        code, _, err = run_cli(generate.main, flags, monkeypatch, capsys)
        assert code == 2 and err == (f"error: --temperature={float(temperature)} is too small to mean anything "
                                     "but greedy; use 0 (greedy) or at least 1e-3")
    else:
        generate.main(flags)  # fp64 scores: no overflow, no NaN
        assert capsys.readouterr().out.startswith("To be")


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_non_finite_weights_in_generate_are_one_line(kind, temperature, gen_ckpts, monkeypatch, capsys):
    flags = [f"--ckpt={gen_ckpts[kind]}", "--prompt=To be", "--max_new_tokens=4", "--device=cpu",
             f"--temperature={temperature}"]
    code, _, err = run_cli(generate.main, flags, monkeypatch, capsys)
    assert code == 2
    assert err == (f"error: {gen_ckpts[kind]}: the model's scores are not finite (NaN or infinite weights?); the "
                   "checkpoint is damaged or diverged")


# ------------------------------------------------------------- 6. results files: checked before any work


def script_argv(script: str, tmp_path: Path, monkeypatch) -> tuple:
    """(main, the flags of a run that would fail later, at its first piece of work)."""
    missing = f"--ckpt={tmp_path / 'missing.pt'}"  # read before anything else is done

    def no_work(*args, **kwargs):
        raise AssertionError("worked before checking --json")

    monkeypatch.setattr(bench, "run_bench", no_work)
    monkeypatch.setattr(compare, "run_compare", no_work)
    return {"eval": (evaluation.main, [missing]), "glue": (glue.main, [missing]), "xnli": (xnli.main, [missing]),
            "bench": (bench.main, ["--quick"]), "compare": (compare.main, [f"--out_dir={tmp_path / 'cmp'}"])}[script]


@pytest.mark.parametrize("fault", ["a read-only parent", "a directory", "a parent that is a file"])
@pytest.mark.parametrize("script", ["eval", "glue", "xnli", "bench", "compare"])
def test_an_unwritable_json_is_refused_before_any_work(script, fault, tmp_path, monkeypatch, capsys):
    main, flags = script_argv(script, tmp_path, monkeypatch)
    ro, real_access = tmp_path / "ro", os.access
    ro.mkdir()
    if fault == "a read-only parent":  # what access(2) answers on a read-only filesystem (EROFS), even to root
        path, message = ro / "new" / "r.json", f"--json={ro / 'new' / 'r.json'}: {ro} is not writable; pass a path " \
                                               "you can write"
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == ro else real_access(p, mode, **kw))
    elif fault == "a directory":
        path, message = ro, f"--json={ro} is a directory; pass a file path such as {ro / 'results.json'}"
    else:
        (ro / "file").write_text("x")
        path, message = ro / "file" / "r.json", f"--json={ro / 'file' / 'r.json'}: a folder above it is a file"
    before = snapshot(tmp_path)
    code, out, err = run_cli(main, [*flags, f"--json={path}"], monkeypatch, capsys)
    assert (code, out, err) == (2, "", f"error: {message}")
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ro"]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC], ids=errno.errorcode.get)
def test_a_results_file_that_fails_anyway_goes_to_stdout(code, tmp_path, monkeypatch, capsys):
    """The folder passed the check, then went read-only or filled up during the run: the results are not
    lost with it."""
    real_open = open

    def failing_open(path, mode="r", *args, **kwargs):
        if str(path).endswith(".tmp"):
            if code == errno.ENOSPC:
                return FailingFile(real_open(path, mode, *args, **kwargs), code)
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(safe_files, "open", failing_open, raising=False)
    path, result = tmp_path / "r.json", {"acc": 0.5, "n": 3}
    with pytest.raises(UserError) as e:
        results.write_json(path, result)
    why = "no space left on device" if code == errno.ENOSPC else f"cannot write ({os.strerror(code)})"
    reason = f"{why} while saving {path}; the partial file was removed and no {path} was written"
    assert str(e.value) == f"{reason}; the results were printed on stdout instead"
    assert json.loads(capsys.readouterr().out) == result
    assert list(tmp_path.iterdir()) == []


def test_a_plot_that_fails_anyway_is_one_line(tmp_path, monkeypatch):
    class Figure:  # what save_figure asks of a matplotlib figure (an optional extra)
        def tight_layout(self):
            pass

        def savefig(self, f, **kwargs):
            f.write(b"png")

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(safe_files, "open", read_only, raising=False)
    with pytest.raises(UserError) as e:
        results.save_figure(Figure(), tmp_path / "p.png")
    path = tmp_path / "p.png"
    assert str(e.value) == (f"cannot write (Read-only file system) while saving {path}; the partial file was removed "
                            f"and no {path} was written")
    assert list(tmp_path.iterdir()) == []


def test_eval_prints_its_results_when_the_json_write_fails(recorded_elsewhere, tiny_data_dir, tmp_path, monkeypatch,
                                                           capsys):
    ckpt, _ = recorded_elsewhere

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(safe_files, "open", read_only, raising=False)
    out = tmp_path / "val.json"
    code, stdout, err = run_cli(evaluation.main, [f"--ckpt={ckpt}", "--task=val", "--max_batches=1", "--device=cpu",
                                                  f"--data_root={tiny_data_dir.parent}", f"--json={out}"],
                                monkeypatch, capsys)
    assert code == 2 and err == (f"error: cannot write (Read-only file system) while saving {out}; the partial file "
                                  "was "
                                 f"removed and no {out} was written; the results were printed on "
                                 "stdout instead")
    printed = json.loads(stdout[stdout.index("{"):])
    assert printed["task"] == "val" and math.isfinite(printed["val_ce"]) and not out.exists()


# ------------------------------------------------------------- 7. JSON nested too deeply, numbers too long


DEEP, LONG = "[" * 100_000, '{"text": "a b", "n": ' + "1" * 5000 + "}"


@pytest.mark.parametrize("line, message", [
    (DEEP, "line 2 is JSON nested too deeply to be an example"),
    (LONG, "line 2 holds a number too long to read"),
], ids=["deep", "long"])
@pytest.mark.parametrize("reader", ["eval --data", "xnli --data"])
def test_deep_or_long_jsonl_lines_are_one_line(reader, line, message, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a b", "premise": "a", "hypothesis": "b", "label": 0}\n' + line + "\n")
    read = {"eval --data": lambda: evaluation.read_jsonl(str(path)),
            "xnli --data": lambda: list(xnli.read_jsonl_split(path))}[reader]
    with pytest.raises(UserError) as e:
        read()
    assert str(e.value).startswith(f"{path} {message}") and "\n" not in str(e.value)


@pytest.mark.parametrize("name, text, message", [
    ("deep.json", DEEP, "is JSON nested too deeply"),
    ("deep.toml", "a = " + DEEP, "is TOML nested too deeply"),
    ("long.json", '{"max_iters": ' + "1" * 5000 + "}", "is not valid JSON: Exceeds the limit (4300 digits)"),
    ("list.json", "[1, 2]", "must hold a table of key = value settings"),
], ids=["deep.json", "deep.toml", "long.json", "list.json"])
def test_a_bad_config_file_is_one_line(name, text, message, tmp_path, monkeypatch, capsys):
    (tmp_path / name).write_text(text)
    code, _, err = run_cli(train.main, [f"--config={tmp_path / name}", f"--out_dir={tmp_path / 'o'}"], monkeypatch,
                           capsys)
    assert code == 2 and err.startswith(f"error: config file {tmp_path / name} {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


# ------------------------------------------------------------- 8. folders and files the core cannot use


def test_an_out_dir_below_a_file(tiny_data_dir, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        train.main(train_flags(tiny_data_dir, tmp_path / "f" / "o", "--max_iters=1"))


def test_an_out_dir_on_a_read_only_filesystem(tiny_data_dir, tmp_path, monkeypatch):
    out, real_mkdir = tmp_path / "o", pathlib.Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == out:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    with pytest.raises(UserError, match="Read-only file system"):
        train.main(train_flags(tiny_data_dir, out, "--max_iters=1"))


def test_a_checkpoint_save_on_a_read_only_folder(tiny_data_dir, tmp_path, monkeypatch):
    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(safe_files, "open", read_only, raising=False)
    with pytest.raises(UserError, match="Read-only file system"):
        train.main(train_flags(tiny_data_dir, tmp_path / "o", "--max_iters=1"))


def test_a_damaged_meta_json_of_the_built_in_dataset_is_prepared_again(tmp_path):
    (tmp_path / "shakespeare").mkdir()
    (tmp_path / "shakespeare" / "meta.json").write_text("{not json")
    out = prepare.ensure_dataset("shakespeare", str(tmp_path))
    assert data.load_meta(out)["format"] == data.DATA_FORMAT
