"""Faults found by fault injection (issue 10): non-finite saves, two runs on one folder, a full disk, a
crash before --resume, bad numbers, and eval.py against train.py's own log."""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import math
import os
import re
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from conftest import refused_before_any_work
from helpers import read_ckpt, read_log, snapshot, tiny_config as train_tiny_config

import checkpoint
import checkpoint_format
import common
import finetune
import generate
import plan
import prepare
import safe_files
import train
from common import UserError
from model import GPTConfig
from train import TrainConfig

pytestmark = pytest.mark.usefixtures("small_tiny_preset")


def tiny_config(data_dir, out_dir, **overrides) -> TrainConfig:
    """test_train's settings, shorter: 4 steps of 4 x 32 tokens."""
    short = dict(batch_size=4, max_iters=4, warmup_iters=1, eval_interval=2)
    return train_tiny_config(data_dir, out_dir, **{**short, **overrides})


def resumed(cfg: TrainConfig, **overrides) -> TrainConfig:
    return dataclasses.replace(cfg, resume=True, **overrides)


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "run_id")} for r in records]


# ---------------------------------------------------------------------- 1. never save non-finite weights


def test_signal_during_a_diverging_step_keeps_the_good_checkpoint(tiny_data_dir, tmp_path, monkeypatch):
    cfg = tiny_config(tiny_data_dir, tmp_path)
    train.train(cfg)
    good = (tmp_path / "ckpt.safetensors").read_bytes()
    # The reproduction: `--resume --lr=inf`, Ctrl-C during the first step. That step's loss is
    # finite (computed before the update) but the update makes every weight non-finite.
    real_lr, real_step = plan.lr_at, train.optimizer_step
    monkeypatch.setattr(plan, "lr_at", lambda step, c: math.inf if step >= 4 else real_lr(step, c))

    def step_then_interrupt(*args):
        real_step(*args)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(train, "optimizer_step", step_then_interrupt)
    with pytest.raises(UserError, match=r"not saving .*ckpt.safetensors: weight \S+ is not finite at step 5; the last "
                                        r"good checkpoint is .*ckpt.safetensors \(step 4\)"):
        train.train(resumed(cfg, max_iters=8))
    assert (tmp_path / "ckpt.safetensors").read_bytes() == good
    assert not list(tmp_path.glob(".*.tmp")) and (tmp_path / ".lock").read_bytes() == b""  # released: names nobody


def test_every_save_refuses_a_non_finite_loss_or_metric(tmp_path):
    weights = {"w": torch.ones(2)}
    for bad, message in [({"state": {"step": 3, "loss": math.nan}}, "the training loss is nan at step 3"),
                         ({"state": {"step": 3, "val": {"val_ce": math.inf}}}, "val_ce is inf"),
                         ({"model": {"w": torch.tensor([1.0, math.nan])}}, "weight w is not finite")]:
        with pytest.raises(UserError, match=message):
            checkpoint.save_checkpoint(tmp_path / "ckpt.safetensors", {"model": weights, **bad})
        assert not list(tmp_path.iterdir())
    checkpoint.save_checkpoint(tmp_path / "ckpt.safetensors", {"model": weights, "state": {"step": 3, "loss": 1.5}})
    saved = checkpoint_format.checkpoint_file(tmp_path / "ckpt.safetensors")  # its bytes (no config: no run)
    assert saved["state"]["loss"] == 1.5


# ------------------------------------------------------------------------------ 2. one run per folder


def test_a_second_run_on_the_same_out_dir_is_refused(tiny_data_dir, tmp_path):
    cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=1)
    with safe_files.hold_lock(tmp_path, "training run"):  # the first run, holding out_dir
        with pytest.raises(UserError) as e:
            train.train(cfg)
    message = str(e.value)
    assert "in use by another training run" in message
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message
    assert re.search(r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", message) and "\n" not in message
    assert not (tmp_path / "log.jsonl").exists() and not (tmp_path / "ckpt.safetensors").exists()


def test_a_live_runs_folder_is_named_in_use_at_once_whatever_the_flags(tiny_data_dir, tmp_path):
    """A second `python train.py` while the first runs and has saved: not "holds another run ... continue it with
    --resume" (which the lock would then refuse), but the live run, its pid, and what to do."""
    cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=1)
    with safe_files.hold_lock(tmp_path, "training run"):  # the first run, which has written its log and a checkpoint
        (tmp_path / "log.jsonl").write_text('{"step": 0, "tokens": 0}\n')
        (tmp_path / "ckpt.safetensors").write_bytes(b"the live run's")
        before = snapshot(tmp_path)
        for flags in ({}, {"resume": True}, {"resume": "auto"}, {"overwrite": True}):
            with pytest.raises(UserError) as e:
                train.train(dataclasses.replace(cfg, **flags))
            assert str(e.value) == (f"{tmp_path} is in use by another training run, still running ("
                                    f"{safe_files.lock_info(tmp_path)}): wait for it to end, or stop it (Ctrl-C there "
                                    "saves it, and --resume then continues it), or pick another --out_dir"), flags
            assert f"pid {os.getpid()}" in str(e.value)
            assert snapshot(tmp_path) == before


def test_a_crashed_holder_leaves_no_stale_lock(tmp_path):
    # What a killed run leaves: the lock file with its details, and a lock the kernel already dropped.
    f = open(tmp_path / ".lock", "w")
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write("pid 1 on elsewhere, started long ago\n")
    f.close()
    lock = tmp_path / ".lock"
    with safe_files.hold_lock(tmp_path, "training run"):
        assert f"pid {os.getpid()}" in lock.read_text()
    assert lock.read_bytes() == b""  # released, never unlinked (contract "ownership" in docs/failures.md)


def test_two_preparations_of_one_dataset_folder(tmp_path):
    with prepare.hold_dataset(tmp_path / "data" / "shakespeare"):
        with pytest.raises(UserError, match="in use by another prepare.py preparing it"):
            prepare.prepare(prepare.PrepareConfig(max_docs=1, data_root=str(tmp_path / "data")))


# ------------------------------------------------------------------------------ 3. disk full


class FullDisk:
    """A file that takes `room` more bytes (or characters), then fails as a full disk does."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, b):
        if len(b) > self.room:
            self.file.write(b[:self.room])  # a partial file, as on a real disk
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self.file.write(b)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def fill_disk_after(monkeypatch, opens: int, room: int = 1000) -> None:
    """Every temp file safe_files.atomic_file writes after the first `opens` gets `room` bytes of disk."""
    count = {"n": 0}

    def opener(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if not str(path).endswith(".tmp"):
            return f
        count["n"] += 1
        return f if count["n"] <= opens else FullDisk(f, room)

    monkeypatch.setattr(safe_files, "open", opener, raising=False)


def test_disk_full_during_a_checkpoint_save(tiny_data_dir, tmp_path, monkeypatch, capsys):
    fill_disk_after(monkeypatch, opens=1)  # the save at step 2 succeeds; at step 4 the disk is full
    flags = [f"--dataset={tiny_data_dir}", "--preset=tiny", "--block_size=32", "--batch_size=4",
             "--max_iters=4", "--eval_interval=2", "--eval_batches=2", f"--out_dir={tmp_path}",
             "--device=cpu"]
    monkeypatch.setattr(sys, "argv", ["train.py", *flags])
    with pytest.raises(SystemExit) as e:
        common.run_main(train.main)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2
    assert re.fullmatch(r"error: no space left on device while saving \S+ckpt.safetensors; the partial file was "
                        r"removed and \S+ckpt.safetensors is unchanged; the last good checkpoint is "
                        r"\S+ckpt.safetensors \(step 2\)\. Free some space, then continue with --resume", err), err
    assert read_ckpt(tmp_path / "ckpt.safetensors")["state"]["step"] == 2
    assert not list(tmp_path.glob(".*.tmp"))


def test_disk_full_while_preparing_data(tmp_path, monkeypatch):
    def opener(path, mode="r", *args, **kwargs):  # the dataset's files, in the folder built beside its place
        f = open(path, mode, *args, **kwargs)
        return FullDisk(f, 5000) if safe_files.TEMP_MARK in str(path) else f

    monkeypatch.setattr(prepare, "open", opener, raising=False)
    with pytest.raises(UserError, match=r"^no space left on device while saving \S+shakespeare; the partial folder "
                                        r"was removed and any earlier one is unchanged$"):
        prepare.prepare(prepare.PrepareConfig(dataset="shakespeare", max_docs=2, data_root=str(tmp_path / "d")))
    assert snapshot(tmp_path / "d") == {}  # nothing but the released lock


# ------------------------------------------------------------------------------ 4. resume after a crash


def test_resume_after_a_crash_gives_the_log_of_an_uninterrupted_run(tiny_data_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    train.train(tiny_config(tiny_data_dir, straight, max_iters=6, eval_interval=3))

    crashed = tmp_path / "crashed"
    real_log = train.append_log

    def crash_at_step_5(out_dir, record):  # the last checkpoint is at step 3
        real_log(out_dir, record)
        if record["step"] == 5 and "loss" in record:
            with open(Path(out_dir) / "log.jsonl", "a") as f:
                f.write('{"step": 6, "lo')  # a record cut short by kill -9
            raise RuntimeError("killed")

    monkeypatch.setattr(train, "append_log", crash_at_step_5)
    cfg = tiny_config(tiny_data_dir, crashed, max_iters=6, eval_interval=3)
    with pytest.raises(RuntimeError, match="killed"):
        train.train(cfg)
    monkeypatch.setattr(train, "append_log", real_log)
    dead = crashed / ".ckpt.safetensors.headless-lm-999999999.tmp"  # a save interrupted by kill -9 (no such process)
    live = crashed / f".results.json.headless-lm-{os.getpid()}.tmp"  # another save in progress
    users = crashed / "draft.4242424.tmp"  # a user's own file that only looks like a temp file
    dead.write_bytes(b"partial")
    live.write_bytes(b"in progress")
    users.write_text("notes")

    train.train(resumed(cfg))
    assert without_timing(read_log(crashed)) == without_timing(read_log(straight))
    assert not dead.exists() and live.exists() and users.read_text() == "notes"


# ---------------------------------------------------------------------- 5, 6. bad numbers, one line each


@pytest.mark.parametrize("script, flags, message", [
    ("train", ["--beta1=2"], "--beta1 must be in [0, 1), got 2.0"),
    ("train", ["--beta2=1"], "--beta2 must be in [0, 1), got 1.0"),
    ("train", ["--eps=-1"], "--eps must be > 0, got -1.0"),
    ("train", ["--min_lr=-1"], "--min_lr must be >= 0, got -1.0"),
    ("train", ["--min_lr=0.01"], "--min_lr must be in [0, 0.001], got 0.01"),
    ("train", ["--temperature=1e-40"], "--temperature must be in [0.001, 1000], got 1e-40"),
    ("train", ["--weight_decay=-1"], "--weight_decay must be >= 0, got -1.0"),
    ("train", ["--lr=inf"], "--lr must be a finite number, got inf"),
    ("train", ["--grad_clip=nan"], "--grad_clip must be a finite number, got nan"),
    ("train", ["--warmup_iters=-1"], "--warmup_iters must be in [0, 4294967296], got -1"),
    ("finetune", ["--ckpt=CKPT", "--batch_size=0"], "--batch_size must be in [1, 65536], got 0"),
    ("finetune", ["--ckpt=CKPT", "--budget_fraction=2"], "--budget_fraction must be in (0, 1], got 2.0"),
    ("generate", ["--prompt=Hi", "--temperature=nan"], "--temperature must be a finite number, got nan"),
    ("generate", ["--prompt=Hi", "--temperature=1e-40"], "too small to mean anything but greedy"),
    ("generate", ["--prompt_file=LATIN1"], "is not UTF-8 (byte 3)"),
    ("data", ["--val_fraction=nan"], "--val_fraction must be a finite number, got nan"),
    ("data", ["--num_proc=0"], "--num_proc must be in [1, 1024], got 0"),
])
def test_bad_numbers_are_refused_before_any_work(script, flags, message, tmp_path):
    mains = {"train": train.main, "finetune": finetune.main, "data": prepare.main, "generate": generate.main}
    out = {"train": "--out_dir=OUT/out", "finetune": "--out_dir=OUT/out", "data": "--data_root=OUT/out",
           "generate": "--ckpt=CKPT"}[script]
    refused_before_any_work(mains[script], [out, *flags], message, tmp_path)


def test_a_second_ctrl_c_waits_for_the_save_and_exits_130(tiny_data_dir, tmp_path, monkeypatch, capsys):
    real_bytes, real_log = checkpoint_format.checkpoint_bytes, train.append_log

    def first_ctrl_c_at_step_2(out_dir, record):
        real_log(out_dir, record)
        if record["step"] == 2 and "loss" in record:
            signal.raise_signal(signal.SIGINT)

    def bytes_with_second_ctrl_c(payload):
        for i, piece in enumerate(real_bytes(payload)):
            if i == 1:
                signal.raise_signal(signal.SIGINT)  # arrives mid-save, the header written
            yield piece

    monkeypatch.setattr(train, "append_log", first_ctrl_c_at_step_2)
    monkeypatch.setattr(checkpoint_format, "checkpoint_bytes", bytes_with_second_ctrl_c)
    cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=4, eval_interval=10)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as e:
        common.run_main(lambda argv: train.train(cfg))
    assert e.value.code == 130 and capsys.readouterr().err.endswith("interrupted\n")
    assert read_ckpt(tmp_path / "ckpt.safetensors")["state"]["step"] == 2  # the save completed
    assert not list(tmp_path.glob(".*.tmp"))


# ------------------------------------------------------------------------------ 7. resume with other settings


def test_resume_refuses_another_preset_and_explains_a_longer_schedule(tiny_data_dir, tmp_path, capsys):
    cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=2)
    train.train(cfg)
    with pytest.raises(UserError, match="--preset=pythia-70m but .*ckpt.safetensors holds a tiny model; resume with "
                                        "--preset=tiny"):
        train.train(resumed(cfg, preset="pythia-70m", max_iters=4))
    capsys.readouterr()
    summary = train.train(resumed(cfg, max_iters=4))
    assert summary["step"] == 4
    assert ("note: --max_iters changed from 2 to 4 on resume: the cosine schedule now decays over 4 steps "
            "(lr at step 2: 7.75e-04, was 1.00e-04)") in capsys.readouterr().err


def test_resume_keeps_the_runs_schedule_and_refuses_another_experiment(tiny_data_dir, tmp_path):
    cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=20, warmup_iters=None, eval_interval=20)
    train.train(dataclasses.replace(cfg, max_iters=10))
    recorded = lambda: read_ckpt(tmp_path / "ckpt.safetensors")["train_config"]  # noqa: E731
    assert (recorded()["warmup_iters"], recorded()["min_lr"]) == (1, 1e-4)  # tiny's recipe: 10%, lr / 10
    train.train(resumed(cfg))  # extended to 20 steps: the warmup stays 1 step, not 10% of 20
    assert (recorded()["warmup_iters"], recorded()["max_iters"]) == (1, 20)
    for change in (dict(loss="ce"), dict(batch_size=2), dict(block_size=16), dict(init_from="other.pt")):
        key = next(iter(change))
        with pytest.raises(UserError, match=f"--{key}=.* but .*ckpt.safetensors was trained with --{key}="):
            train.train(resumed(cfg, max_iters=30, **change))


def test_resuming_a_finished_run_adds_nothing(tiny_data_dir, tmp_path):
    cfg = tiny_config(tiny_data_dir, tmp_path)
    train.train(cfg)
    log, ckpt = (tmp_path / "log.jsonl").read_bytes(), (tmp_path / "ckpt.safetensors").read_bytes()
    summary = train.train(dataclasses.replace(cfg, resume="auto"))  # e.g. a scheduler's relaunch
    assert summary["step"] == 4 and summary["val"] is not None
    assert (tmp_path / "log.jsonl").read_bytes() == log and (tmp_path / "ckpt.safetensors").read_bytes() == ckpt


def test_finetune_recipe_of_a_shape_without_one():
    def recipe(preset):
        base = checkpoint.Checkpoint(model={}, model_config=GPTConfig(block_size=64), train_config={"preset": preset})
        cfg = finetune.inherit_settings(finetune.FinetuneConfig(ckpt="x"), base)
        return cfg.lr, cfg.lr_schedule
    assert recipe("tiny") == (3e-4, "constant")
    assert recipe("bert-tiny") == recipe(None) == (1e-4, "cosine")  # the official config's


# ---------------------------------------------------------------------- 8, 10. data: skipped rows, hints


# ---------------------------------------------------------------------- 9. weights that don't fit the config


def as_checkpoint(payload: dict) -> checkpoint.Checkpoint:
    return checkpoint.Checkpoint(payload["model"], GPTConfig(**payload["model_config"]))


def test_mismatched_weights_name_the_first_tensor(tmp_path):
    from model import build_model

    model = build_model("tiny", 64, d_model=32, n_layer=1, n_head=2, block_size=16)
    config = dataclasses.asdict(model.config)
    wider = {"model": model.state_dict(), "model_config": {**config, "d_model": 64}}
    with pytest.raises(UserError, match=r"ckpt.safetensors does not match this model code: tensor wte.weight has "
                                        r"shape \[64, 32\] in the weights but \[64, 64\] in the model"):
        checkpoint.checkpoint_model(as_checkpoint(wider), "ckpt.safetensors")
    deeper = {"model": model.state_dict(), "model_config": {**config, "n_layer": 2}}
    with pytest.raises(UserError, match=r"the weights hold 1 layers but the config says 2"):
        checkpoint.checkpoint_model(as_checkpoint(deeper), "ckpt.safetensors")
    missing = {"model": {k: v for k, v in model.state_dict().items() if "mlp" not in k}, "model_config": config}
    with pytest.raises(UserError, match=r"tensor blocks.0.mlp.\S+ \(and 3 more\) missing from the weights"):
        checkpoint.checkpoint_model(as_checkpoint(missing), "ckpt.safetensors")
    # a config's sizes are never trusted: a million layers costs nothing before the weights are compared
    huge = {"model": model.state_dict(), "model_config": {**config, "n_layer": 10**6, "d_model": 10**6}}
    with pytest.raises(UserError, match="the weights hold 1 layers but the config says 1000000"):
        checkpoint.checkpoint_model(as_checkpoint(huge), "ckpt.safetensors")


# ---------------------------------------------------------------------- issue 33, contract 5: one line means one line


def test_an_error_is_one_escaped_line_of_bounded_length_after_the_progress_bar(monkeypatch, capsys):
    """Text from a file inside an error (newlines that would forge `error:` and `Traceback` lines, a terminal's
    escapes, 5 MB of it) is escaped and cut in the middle, keeping the fix at its end; an open tqdm bar (an error
    used to be glued to it) is closed first, so that the error starts a line of its own."""
    from tqdm import tqdm

    def main(argv):
        bar = tqdm(total=10, desc="working", file=sys.stderr)
        bar.update(3)
        raise UserError(argv[0] + "; the fix")

    for text, shown in [("a\nerror: forged\nTraceback (most recent call last):\x1b[2J", "a\\nerror: forged\\nTraceback"
                         " (most recent call last):\\x1b[2J; the fix"), ("A" * 5_000_000, " ... " + "A" * 900)]:
        monkeypatch.setattr(sys, "argv", ["script.py", text])
        with pytest.raises(SystemExit) as e:
            common.run_main(main)
        err = capsys.readouterr().err
        last = err.split("\n")[-2]
        assert e.value.code == 2 and err.endswith("\n") and last.startswith("error: ") and "\n" not in last
        assert shown in last and last.endswith("; the fix") and len(last) <= common.MAX_ERROR_CHARS
        assert err.split("\n")[:-2] == [err.split("\n")[0]] and "working:  30%" in err.split("\n")[0]  # the bar


def test_a_signal_at_a_runs_very_end_stops_the_whole_command(tiny_data_dir, tmp_path, monkeypatch, capsys):
    """SIGTERM during the last validation: the run saves its last checkpoint and train.py exits 143, not 0 (a
    caller, compare.py or a shell's `&&`, must not go on as if nothing came)."""
    real = train.Run.validate

    def validate_then_signal(self):
        real(self)
        if self.state.step == self.cfg.max_iters:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(train.Run, "validate", validate_then_signal)
    cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=2)
    summary = train.train(cfg)
    assert summary["interrupted"] and summary["signal"] == signal.SIGTERM and summary["step"] == 2
    assert read_ckpt(tmp_path / "ckpt.safetensors")["state"]["step"] == 2
