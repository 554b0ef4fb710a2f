"""compare.py: the equal-compute budget and the whole CE vs CWT (+ fine-tune) experiment."""
from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import refused_before_any_work
from helpers import read_log, run_cli, snapshot, without_timing

import common
import compare
import train
from common import UserError

pytestmark = pytest.mark.usefixtures("small_tiny_preset")


def test_flop_budget_solver_gives_equal_budgets():
    # CE 100 steps at 44 FLOPs/token; CWT at 6 plus 2% of its steps fine-tuned at CE's 44:
    # 6n + 44 ceil(n/50) <= 4400
    n, ft = compare.solve_cwt_iters(100, 44.0, 6.0, 0.02)
    assert (n, ft) == (638, 13)
    assert 6 * 638 + 44 * 13 == 100 * 44  # exactly the budget here
    assert 6 * 639 + 44 * 13 > 100 * 44  # one more step would exceed it


def test_compare_end_to_end(tiny_data_dir, tmp_path):
    cfg = compare.CompareConfig(dataset=str(tiny_data_dir), quick=True, out_dir=str(tmp_path / "cmp"),
                                device="cpu")
    result = compare.run_compare(cfg)
    runs, budget = result["runs"], result["budget_flops"]
    assert runs["ce"]["flops"] == pytest.approx(budget)
    assert runs["cwt"]["flops"] < runs["cwt-ft"]["flops"] <= budget * (1 + 1e-9)
    one_more = result["tokens_per_iter"] * (result["flops_per_token"]["cwt"]
                                            + result["flops_per_token"]["ce"])
    assert runs["cwt-ft"]["flops"] > budget - one_more  # CWT gets all the budget it can use
    assert all(run["val_ce"] > 0 for run in runs.values())
    for _name, curve in result["curves"].items():
        assert curve and all(x2 >= x1 for (x1, _), (x2, _) in zip(curve, curve[1:]))
    assert result["curves"]["cwt-ft"][0][0] == pytest.approx(runs["cwt"]["flops"])
    assert "skipped" in runs["ce"]["lambada"]["note"]


def test_bad_numbers_are_refused_before_any_work(tmp_path):
    refused_before_any_work(compare.main, ["--out_dir=OUT/out", "--ce_iters=0"], "--ce_iters must be at least 1, got 0",
                            tmp_path)


# ------------------------------------------------------------- a second compare.py into the same out_dir


def spy_on_runs(monkeypatch) -> list[tuple]:
    """(train or finetune, the run's folder name, its resume and overwrite settings) of every run started."""
    calls = []
    for name in ("train", "finetune"):
        real = getattr(compare, name)

        def started(cfg, real=real, name=name):
            calls.append((name, Path(cfg.out_dir).name, cfg.resume, cfg.overwrite))
            return real(cfg)

        monkeypatch.setattr(compare, name, started)
    return calls


def logs(out: Path) -> dict[str, list[dict]]:
    return {name: without_timing(read_log(out / name)) for name in compare.RUNS}


def test_a_second_compare_is_refused_unless_resumed_or_overwritten(tiny_data_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    flags = [f"--dataset={tiny_data_dir}", "--quick", f"--out_dir={out}", "--device=cpu"]
    cfg = common.parse_flags(compare.CompareConfig, flags)
    first = compare.run_compare(cfg)
    before = snapshot(out)
    calls = spy_on_runs(monkeypatch)
    # without a flag: one line, exit 2, before any work
    code, _, err = run_cli(compare.main, flags, monkeypatch, capsys)
    assert code == 2 and err == (f"error: {out} holds the runs of an earlier compare.py (ce, cwt, cwt-ft); continue "
                                 "them with --resume (same settings), start every run over with --overwrite, or "
                                 "pick another --out_dir")
    code, _, err = run_cli(compare.main, [*flags, "--resume", "--overwrite"], monkeypatch, capsys)
    assert code == 2 and err == ("error: --resume continues the runs in --out_dir and --overwrite starts them over: "
                                 "pass one")
    with pytest.raises(UserError, match=rf"^{out / 'ce'} holds a run with lr=0.001 but this compare.py plans "
                                        r"lr=0.002; resume with that run's settings, start over with --overwrite"):
        compare.run_compare(dataclasses.replace(cfg, resume=True, lr=2e-3))  # another experiment
    assert calls == [] and snapshot(out) == before
    # --resume: every run finished, so none trains and nothing changes
    again = compare.run_compare(dataclasses.replace(cfg, resume=True))
    assert calls == [] and snapshot(out) == before
    assert again["runs"] == {name: {**run, "seconds": None} for name, run in first["runs"].items()}
    assert again["curves"] == first["curves"] and "| - (earlier) |" in compare.compare_table(again)
    # --overwrite: every run starts over, its log a log of the new run alone
    compare.run_compare(dataclasses.replace(cfg, overwrite=True))
    assert calls == [("train", "ce", False, True), ("train", "cwt", False, True),
                     ("finetune", "cwt-ft", False, True)]
    assert logs(out) == {name: without_timing([json.loads(line) for line in before[f"{name}/log.jsonl"].splitlines()])
                         for name in compare.RUNS}


def test_an_interrupted_compare_continues_with_resume(tiny_data_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    cfg = compare.CompareConfig(dataset=str(tiny_data_dir), quick=True, out_dir=str(out), device="cpu")
    straight = compare.run_compare(cfg)
    planned, reference = straight["iters"], logs(out)
    assert planned["cwt"] > 1
    # --overwrite, and Ctrl-C during CWT's first step: the step ends, CWT saves, compare.py stops
    real_step, steps = train.optimizer_step, []

    def ctrl_c_in_cwts_first_step(*args):
        real_step(*args)
        steps.append(1)
        if len(steps) == planned["ce"] + 1:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(train, "optimizer_step", ctrl_c_in_cwts_first_step)
    with pytest.raises(common.Interrupted) as stopped:  # exit 130 after the save
        compare.run_compare(dataclasses.replace(cfg, overwrite=True))
    assert stopped.value.signum == signal.SIGINT
    assert "compare.py stopped during cwt; continue it with the same settings and --resume" in capsys.readouterr().err
    step = {name: torch.load(out / name / "ckpt.pt", weights_only=True)["step"] for name in compare.RUNS}
    assert step == {"ce": planned["ce"], "cwt": 1, "cwt-ft": planned["cwt-ft"]}  # cwt-ft: the earlier compare's
    # --resume: CE finished (skipped), CWT continues where it stopped, its stale fine-tune starts over
    monkeypatch.setattr(train, "optimizer_step", real_step)
    calls = spy_on_runs(monkeypatch)
    resumed = compare.run_compare(dataclasses.replace(cfg, resume=True))
    assert calls == [("train", "cwt", "auto", False), ("finetune", "cwt-ft", False, True)]
    err = capsys.readouterr().err
    assert f"{out / 'ce'}: finished earlier ({planned['ce']} steps); skipped" in err
    assert f"{out / 'cwt-ft'}: it fine-tuned an earlier state of {out / 'cwt'}; starting it over" in err
    assert logs(out) == reference  # as if never interrupted
    assert {k: r["val_ce"] for k, r in resumed["runs"].items()} == {k: r["val_ce"] for k, r in straight["runs"].items()}


def test_an_out_dir_that_is_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "cmp"):
        with pytest.raises(UserError) as e:
            compare.run_compare(compare.CompareConfig(out_dir=str(out), quick=True, data_root=str(tmp_path / "d")))
        assert str(e.value) == f"--out_dir={out}: it, or a folder above it, is a file; pass a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no dataset prepared


@pytest.mark.usefixtures("small_tiny_preset")
def test_a_run_stopped_before_its_last_validation_is_not_finished(tiny_data_dir, tmp_path):
    """compare.py --resume took a run at its last step for finished even when the stop came before that
    step's validation, and tabled the previous validation's numbers."""
    from helpers import tiny_config

    run_cfg = tiny_config(tiny_data_dir, tmp_path, max_iters=4, eval_interval=2)
    train.train(run_cfg)
    assert compare.finished_run(run_cfg)["step"] == 4
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    ckpt["state"]["val_step"] = 2  # as a stop during step 4 leaves it
    torch.save(ckpt, tmp_path / "ckpt.pt")
    assert compare.finished_run(run_cfg) is None
