"""Every number right (the core's part): a run stopped anywhere and resumed is the uninterrupted run (weights,
log, final validation), stops exit 130 or 143 after their save, and the settled counts: FLOPs of a frozen
body, contrastive metrics weighted by rows, a resumed lr below its min_lr."""
from __future__ import annotations

import dataclasses
import math
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import read_ckpt, read_log, run_cli, tiny_config
from hypothesis import example, given, settings, strategies as st

import data
import finetune
import train
from common import STOP_LINES, UserError
from model import build_model

pytestmark = pytest.mark.usefixtures("small_tiny_preset", "one_thread")
SIGNALS = {"SIGINT": 130, "SIGTERM": 143}


def run_config(data_dir: Path, out_dir: Path, **overrides) -> train.TrainConfig:
    """6 steps of 2 micro-batches, validations at steps 0, 3 and 6, dropout (random state that must resume)."""
    return tiny_config(data_dir, out_dir, max_iters=6, eval_interval=3, grad_accum=2, dropout=0.1, **overrides)


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "run_id")} for r in records]


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return read_ckpt(out_dir / "ckpt.safetensors")["model"]


@pytest.fixture(scope="module")
def straight(tiny_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(__import__("model").PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))
        summary = train.train(run_config(tiny_data_dir, out))
    return out, summary


@settings(max_examples=4, deadline=None)
@given(st.one_of(st.tuples(st.just("micro-batch"), st.integers(0, 11)),
                 st.tuples(st.just("validation"), st.sampled_from([0, 3, 6]))))
@example(("micro-batch", 11))  # inside the last step: its validation is owed to --resume
@example(("validation", 3))  # while validating: the point stays in the log
def test_a_stop_anywhere_then_resume_is_the_uninterrupted_run(tiny_data_dir, straight, where):
    """Ctrl-C inside micro-batch i (a step's middle, the last step's end) or during the validation at step s,
    then --resume: the same weights, log and final validation as a run never stopped."""
    kind, at = where
    out = Path(tempfile.mkdtemp())
    cfg = run_config(tiny_data_dir, out)
    with pytest.MonkeyPatch.context() as mp:
        if kind == "micro-batch":
            real_get = data.BatchSampler.get

            def get(self, index):
                if index == at:
                    signal.raise_signal(signal.SIGINT)
                return real_get(self, index)
            mp.setattr(data.BatchSampler, "get", get)
        else:
            real_evaluate = train.evaluate

            def evaluate(*args, **kwargs):
                if state_step() == at:
                    signal.raise_signal(signal.SIGINT)
                return real_evaluate(*args, **kwargs)

            def state_step():
                return len([r for r in read_log(out) if "loss" in r]) if (out / "log.jsonl").exists() else 0
            mp.setattr(train, "evaluate", evaluate)
        stopped = train.train(cfg)
    summary = train.train(dataclasses.replace(cfg, resume=True)) if stopped["interrupted"] else stopped
    straight_out, straight_summary = straight
    assert summary["val"] == straight_summary["val"] and summary["step"] == 6
    assert without_timing(read_log(out)) == without_timing(read_log(straight_out))
    ours = final_weights(out)
    assert all(torch.equal(ours[k], v) for k, v in final_weights(straight_out).items())


def test_a_stop_in_the_last_step_is_not_done(tiny_data_dir, tmp_path):
    """The last step's validation is owed: the checkpoint says so, the summary says interrupted, and --resume
    runs it (not "done" with the previous validation's numbers)."""
    cfg = run_config(tiny_data_dir, tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        real_get = data.BatchSampler.get
        mp.setattr(data.BatchSampler, "get", lambda self, i: (signal.raise_signal(signal.SIGINT) if i == 11
                                                              else None) or real_get(self, i))
        stopped = train.train(cfg)
    state = read_ckpt(tmp_path / "ckpt.safetensors")["state"]
    assert stopped["interrupted"] and stopped["step"] == 6 and state["val_step"] == 3
    resumed = train.train(dataclasses.replace(cfg, resume=True))
    assert not resumed["interrupted"] and resumed["val"] != stopped["val"]
    assert [r["step"] for r in read_log(tmp_path) if "val_ce" in r] == [0, 3, 6]


@pytest.mark.parametrize("name", SIGNALS)
def test_a_stopped_training_exits_with_the_signals_code_after_its_save(name, tiny_data_dir, tmp_path, monkeypatch,
                                                                       capsys):
    real_get = data.BatchSampler.get

    def get(self, index):
        if index == 2:
            signal.raise_signal(getattr(signal, name))
        return real_get(self, index)
    monkeypatch.setattr(data.BatchSampler, "get", get)
    flags = [f"--dataset={tiny_data_dir}", "--preset=tiny", "--block_size=32", "--max_iters=6", "--eval_interval=3",
             "--eval_batches=2", f"--out_dir={tmp_path}", "--device=cpu"]
    code, _, err = run_cli(train.main, flags, monkeypatch, capsys)
    assert code == SIGNALS[name] and err == STOP_LINES[getattr(signal, name)]  # after "stopped at step 3; ..."
    assert read_ckpt(tmp_path / "ckpt.safetensors")["state"]["step"] == 3


def test_a_stopped_finetune_exits_143(tiny_data_dir, straight, tmp_path, monkeypatch, capsys):
    real_get = data.BatchSampler.get
    second = read_ckpt(straight[0] / "ckpt.safetensors")["state"]["micro_batches"] + 1  # reads on there
    monkeypatch.setattr(data.BatchSampler, "get", lambda self, i: (signal.raise_signal(signal.SIGTERM) if i == second
                                                                   else None) or real_get(self, i))
    flags = [f"--ckpt={straight[0] / 'ckpt.safetensors'}", "--max_iters=3", f"--out_dir={tmp_path}", "--grad_accum=1",
             f"--data_root={tiny_data_dir.parent}"]
    code, _, err = run_cli(finetune.main, flags, monkeypatch, capsys)
    assert code == 143 and read_ckpt(tmp_path / "ckpt.safetensors")["state"]["step"] == 2


def test_a_frozen_body_is_charged_its_forward_and_the_heads_gradient(tiny_data_dir, straight, tmp_path):
    model = build_model("tiny", 50304, block_size=32)
    n, d, layers, v, t = model.num_params(False), 64, 2, 50304, 32
    assert model.flops_per_token(t, v, body_backward=False) == 2 * n + 4 * layers * d * t + 4 * d * v
    assert model.flops_per_token(t, v) == 6 * n + 12 * layers * d * t + 6 * d * v
    cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=2, eval_interval=2,
                      init_from=str(straight[0] / "ckpt.safetensors"), add_lm_head=True, freeze_body=True, loss="ce")
    summary = train.train(cfg)
    spent = summary["flops"] - straight[1]["flops"]
    assert spent == pytest.approx(2 * 8 * 32 * model.flops_per_token(32, 50304, body_backward=False), rel=1e-12)


def test_contrastive_metrics_weigh_every_row_alike():
    """A short last batch (fewer rows, fewer negatives) counts by its rows, as val_ce does: the mean over all
    rows of each row's CWT loss and top-1 hit (in-batch negatives of its own batch), in float64."""
    torch.manual_seed(0)
    model = build_model("tiny", 64, block_size=8, n_layer=1, d_model=16, n_head=2).double()
    tokens = torch.randint(0, 60, (8 * 5 + 1,)).numpy()  # 5 windows of 8: batches of 2, 2 and 1
    got = train.evaluate(train.Objective(model, train.LossConfig(loss="cwt")), train.ValSplit(tokens),
                         train.Validation(batch_size=2, block_size=8))
    losses, hits = [], []
    with torch.no_grad():
        for first, count in ((0, 2), (2, 2), (4, 1)):
            x = torch.stack([torch.tensor(tokens[w * 8:w * 8 + 8]) for w in range(first, first + count)]).long()
            y = torch.stack([torch.tensor(tokens[w * 8 + 1:w * 8 + 9]) for w in range(first, first + count)]).long()
            h = model.hidden(x).reshape(-1, 16)
            e = model.wte.weight[y.reshape(-1)]
            scores = h @ e.T
            losses += F.cross_entropy(scores, torch.arange(len(h)), reduction="none").tolist()
            hits += (y.reshape(-1)[scores.argmax(1)] == y.reshape(-1)).tolist()
    assert got["val_cwt"] == pytest.approx(sum(losses) / len(losses), rel=1e-9)
    assert got["val_acc"] == pytest.approx(sum(hits) / len(hits), rel=1e-12)
    assert math.isfinite(got["val_ppl"]) and got["val_ppl"] == pytest.approx(math.exp(got["val_ce"]))


def test_a_resumed_lr_below_its_min_lr_is_refused(tiny_data_dir, tmp_path):
    cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=2, eval_interval=2, warmup_iters=None)
    train.train(cfg)  # tiny's recipe: min_lr = lr / 10 = 1e-4, recorded
    with pytest.raises(UserError, match=r"--lr=5e-05 is below the min_lr 0.0001 this run resumes with; pass "
                                        r"--min_lr too"):
        train.train(dataclasses.replace(cfg, max_iters=4, lr=5e-5, resume=True))
    summary = train.train(dataclasses.replace(cfg, max_iters=4, lr=5e-5, min_lr=1e-5, resume=True))
    assert summary["step"] == 4
