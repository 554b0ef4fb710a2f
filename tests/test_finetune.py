import contextlib
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers import read_ckpt, read_log, refusal, tree_state

import common
import safe_files
import train
from checkpoint import load_model
from common import UserError
from finetune import finetune, finetune_budget, main as finetune_main, resolve_config
from loss import LossConfig
from train import Objective, evaluate

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("small_tiny_preset")


@pytest.fixture
def data_root(tiny_data_dir) -> str:
    """The flag that finds the checkpoint's dataset (a path inside a checkpoint is never opened)."""
    return f"--data_root={tiny_data_dir.parent}"


@pytest.fixture
def cwt_checkpoint(tiny_data_dir, tmp_path_factory, small_tiny_preset):
    """A briefly pre-trained headless (CWT) model (made once, reused by every test here)."""
    path = tmp_path_factory.getbasetemp() / "cwt" / "ckpt.safetensors"
    if path.exists():
        return path
    out = path.parent
    train.train(train.TrainConfig(dataset=str(tiny_data_dir), preset="tiny", block_size=32, batch_size=8,
                                  max_iters=40, warmup_iters=5, lr=3e-3, eval_interval=40, eval_batches=4,
                                  out_dir=str(out), device="cpu", seed=0, loss="cwt"))
    return path


def test_budget_is_two_percent_of_pretraining_tokens():
    assert finetune_budget(1_000_000, tokens_per_iter=1000) == 20
    assert finetune_budget(1_000_000, tokens_per_iter=3000) == 7  # rounded up
    assert finetune_budget(1_000_000, 1000, fraction=0.1) == 100
    assert finetune_budget(1_000_000, 1000, tokens=5500) == 6
    assert finetune_budget(1_000_000, 1000, tokens=5500, max_iters=3) == 3
    assert finetune_budget(10, 1000) == 1  # never zero steps


def test_settings_are_inherited_from_the_pretraining_run(cwt_checkpoint, data_root, tmp_path):
    cfg = resolve_config([f"--ckpt={cwt_checkpoint}", f"--out_dir={tmp_path}", data_root, "--batch_size=4"])
    assert cfg.block_size == 32 and cfg.preset == "tiny" and cfg.batch_size == 4  # flag beats inherited
    assert cfg.loss == "ce" and cfg.lr_schedule == "constant"


def test_finetune_adds_a_head_and_lowers_validation_ce(cwt_checkpoint, data_root, tmp_path):
    raw = load_model(str(cwt_checkpoint))
    assert raw.lm_head is None
    cfg = resolve_config([f"--ckpt={cwt_checkpoint}", f"--out_dir={tmp_path}", data_root, "--eval_interval=1000",
                          "--budget_fraction=0.5", "--lr=1e-3"])
    summary = finetune(cfg)
    assert summary["step"] == 20  # 50% of 40 steps x 256 tokens, at 256 tokens a step
    before, after = summary["first_val"]["val_ce"], summary["val"]["val_ce"]
    # step 0 is the raw model: the head is a copy of E, so its CE is the raw model's tied-scoring CE
    expected_raw = evaluate(Objective(raw, LossConfig(loss="ce")), *_val_args(cwt_checkpoint))["val_ce"]
    assert before == pytest.approx(expected_raw, rel=1e-5)
    assert after < before - 0.5, (before, after)
    tuned = load_model(str(tmp_path / "ckpt.safetensors"))
    assert tuned.lm_head is not None
    ckpt = read_ckpt(tmp_path / "ckpt.safetensors")
    assert ckpt["state"]["earlier_tokens"] == 40 * 8 * 32 and ckpt["state"]["tokens"] == 20 * 8 * 32
    # the paper's warmup share (20% of the steps); a cosine schedule would decay to lr / 10
    assert ckpt["train_config"]["warmup_iters"] == 4 and ckpt["train_config"]["min_lr"] == pytest.approx(1e-4)
    # compute is counted in FLOPs: the fine-tune pays the full vocabulary head (V columns per token),
    # the CWT pre-training only the batch's candidates (8 x 32 columns)
    def flops_at(columns):
        return tuned.flops_per_token(32, columns)
    expected = (20 * 256 * flops_at(tuned.config.vocab_size)) / (40 * 256 * flops_at(256))
    assert summary["compute_fraction"] == pytest.approx(expected, rel=1e-9)


def _val_args(ckpt_path):
    ckpt = read_ckpt(ckpt_path)
    from data import open_split
    cfg = ckpt["train_config"]
    tokens = open_split(cfg["dataset"], "val")
    return train.ValSplit(tokens), train.Validation(batch_size=cfg["batch_size"], block_size=32,
                                                    max_batches=cfg["eval_batches"])


def test_freeze_body_trains_only_the_head(cwt_checkpoint, data_root, tmp_path):
    cfg = resolve_config([f"--ckpt={cwt_checkpoint}", f"--out_dir={tmp_path}", data_root, "--max_iters=3",
                          "--freeze_body", "--eval_batches=1"])
    finetune(cfg)
    before = load_model(str(cwt_checkpoint)).state_dict()
    after = load_model(str(tmp_path / "ckpt.safetensors")).state_dict()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0)
    assert not torch.equal(after["lm_head.weight"], before["wte.weight"])


def test_resume_with_other_trainable_parameters_is_a_clear_error(cwt_checkpoint, data_root, tmp_path):
    flags = [f"--ckpt={cwt_checkpoint}", f"--out_dir={tmp_path}", data_root, "--max_iters=2", "--eval_batches=1"]
    finetune(resolve_config(flags))
    with pytest.raises(UserError, match="optimizer of other trainable parameters"):
        finetune(resolve_config(flags + ["--resume", "--max_iters=3", "--freeze_body"]))


def test_a_resumed_finetune_keeps_its_own_learning_rate(cwt_checkpoint, data_root, tmp_path):
    """Not the preset's recipe (3e-4 for tiny): the lr it was started with, unless given again."""
    flags = [f"--ckpt={cwt_checkpoint}", f"--out_dir={tmp_path}", data_root, "--eval_batches=1", "--lr=1e-4"]
    finetune(resolve_config([*flags, "--max_iters=2"]))
    finetune(resolve_config([*flags[:-1], "--resume", "--max_iters=3"]))
    lrs = {r["step"]: r["lr"] for r in read_log(tmp_path) if "loss" in r}  # logged: each run's last step
    assert lrs == {2: pytest.approx(1e-4), 3: pytest.approx(1e-4)}  # constant after a warmup of 1 step


def test_a_resumed_finetune_keeps_its_budget_steps_and_warmup(cwt_checkpoint, data_root, tmp_path, monkeypatch):
    """Issue 39: a 6-step fine-tune (--budget_fraction=0.15) stopped at step 1 and continued with `--resume` alone
    (no --ckpt, no budget) runs its 6 steps with its warmup, as the straight one does (before: "done: 2 steps")."""
    flags = [f"--ckpt={cwt_checkpoint}", data_root, "--budget_fraction=0.15", "--eval_interval=3", "--eval_batches=1"]
    straight = finetune(resolve_config([*flags, f"--out_dir={tmp_path / 'straight'}"]))
    assert straight["step"] == 6
    real = train.Run.step

    def stop_at_the_first_step(self, *args):
        monkeypatch.setattr(train.Run, "step", real)
        signal.raise_signal(signal.SIGINT)
        return real(self, *args)

    monkeypatch.setattr(train.Run, "step", stop_at_the_first_step)
    stopped = finetune(resolve_config([*flags, f"--out_dir={tmp_path / 'resumed'}"]))
    assert stopped["interrupted"] and stopped["step"] == 1
    resumed = finetune(resolve_config(["--resume", f"--out_dir={tmp_path / 'resumed'}", data_root]))
    assert resumed["step"] == 6

    def logged(d):
        return [(r["step"], r.get("loss"), r.get("lr"), r.get("val_ce")) for r in read_log(d)]
    assert logged(tmp_path / "resumed") == logged(tmp_path / "straight")
    saved = read_ckpt(tmp_path / "resumed" / "ckpt.safetensors")["train_config"]
    assert (saved["max_iters"], saved["warmup_iters"], saved["ckpt"]) == (6, 1, str(cwt_checkpoint))


@pytest.mark.parametrize("flags, message", [
    ([], "missing --ckpt=PATH"),
    (["--ckpt=nope.pt"], "checkpoint nope.pt not found"),
    (["--ckpt=CKPT", "--loss=cwt"], "trains the LM head with cross-entropy"),
    (["--ckpt=CKPT", "--budget_fraction=2"], "--budget_fraction must be in (0, 1]"),
])
def test_bad_input(flags, message, cwt_checkpoint, tmp_path, command_worker):
    flags = [f.replace("CKPT", str(cwt_checkpoint)) for f in flags]
    # as `python finetune.py ...` ends (common.run_main: its stderr and exit code), in one process for the table
    result = command_worker.run("finetune", [*flags, f"--out_dir={tmp_path / 'o'}"], ROOT, timeout=120)
    assert result["code"] == 2, result
    lines = result["err"].strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result["err"]
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------- issue 33: contracts 1, 5 (docs/failures.md)

FINETUNE_CASES = {  # case: (flags, given tmp_path and a run folder holding a checkpoint; what the one line says)
    "--ckpt=D/ckpt.safetensors --out_dir=D --overwrite": (
        lambda t, run: [f"--ckpt={run / 'ckpt.safetensors'}", f"--out_dir={run}", "--overwrite"],
        "--out_dir={run}/ckpt.safetensors is also an input of this command"),
    "--ckpt of a run still training": (
        lambda t, run: [f"--ckpt={run / 'ckpt.safetensors'}", f"--out_dir={t / 'ft'}"],
        "--ckpt={run}/ckpt.safetensors is the checkpoint of a run still training in {run}"),
    "--init_from": (
        lambda t, run: [f"--ckpt={run / 'ckpt.safetensors'}", f"--init_from={t / 'x.pt'}", f"--out_dir={t / 'ft'}"],
        "changes nothing in finetune.py (it starts from --ckpt)"),
    "--budget_fraction with --max_iters": (
        lambda t, run: [f"--ckpt={run / 'ckpt.safetensors'}", "--budget_fraction=0.1", "--max_iters=3",
                        f"--out_dir={t / 'ft'}"],
        "--budget_fraction=0.1 changes nothing with --max_iters or --tokens"),
    "--tokens with --max_iters": (
        lambda t, run: [f"--ckpt={run / 'ckpt.safetensors'}", "--tokens=1000", "--max_iters=3",
                        f"--out_dir={t / 'ft'}"],
        "--tokens=1000 changes nothing with --max_iters"),
}


@pytest.mark.parametrize("case", FINETUNE_CASES)
def test_finetune_refuses_each_case_in_one_line_and_changes_nothing(case, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.safetensors").write_bytes(b"a checkpoint: never read, the refusal comes first")
    flags, words = FINETUNE_CASES[case]
    with safe_files.hold_lock(run, "training run") if "still training" in case else contextlib.nullcontext():
        before = tree_state(tmp_path)
        err = refusal(finetune_main, flags(tmp_path, run), monkeypatch, capsys)
        assert tree_state(tmp_path) == before
    assert words.format(run=run) in err, err


def test_a_stopped_finetune_prints_no_finished_summary(cwt_checkpoint, data_root, tmp_path, monkeypatch, capsys):
    """Ctrl-C during a fine-tune: it saves and exits 130, and never prints the "before -> after" line of a
    fine-tune that finished."""
    real = train.Run.step

    def step_then_stop(self, *args):
        signal.raise_signal(signal.SIGINT)
        return real(self, *args)

    monkeypatch.setattr(train.Run, "step", step_then_stop)
    monkeypatch.setattr(sys, "argv", ["finetune.py", f"--ckpt={cwt_checkpoint}", f"--out_dir={tmp_path / 'ft'}",
                                      data_root, "--max_iters=3", "--eval_interval=3"])
    with pytest.raises(SystemExit) as e:
        common.run_main(finetune_main)
    err = capsys.readouterr().err
    assert e.value.code == 130 and "stopped at step 1" in err and "validation CE:" not in err, err
