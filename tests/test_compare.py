"""compare.py: the equal-compute budget and the whole CE vs CWT (+ fine-tune) experiment."""
from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
from conftest import refused_before_any_work
from helpers import (
    one_error_line,
    read_ckpt,
    read_log,
    refusal,
    run_cli,
    save_ckpt,
    snapshot,
    tree_state,
    without_timing,
)
from hypothesis import HealthCheck, given, settings, strategies as st

import cli
import common
import compare
import prepare
import sources
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
    refused_before_any_work(compare.main, ["--out_dir=OUT/out", "--ce_iters=0"],
                            "--ce_iters must be in [1, 1000000000], got 0", tmp_path)


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
    cfg = cli.parse_flags(compare.CompareConfig, flags)
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
    step = {name: read_ckpt(out / name / "ckpt.safetensors")["state"]["step"] for name in compare.RUNS}
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
    ckpt = read_ckpt(tmp_path / "ckpt.safetensors")
    ckpt["state"]["val_step"] = 2  # as a stop during step 4 leaves it
    save_ckpt(ckpt, tmp_path / "ckpt.safetensors")
    assert compare.finished_run(run_cfg) is None


# ------------------------------------------------------------- issue 33: contracts 1, 5, 6, and compare.py's state


COMPARE_CASES = {  # case: (flags given tmp_path; what the one line says)
    "--json= its --lambada file": (lambda t: (t / "l.jsonl").write_text('{"text": "a b"}\n') and
                                   [f"--lambada={t / 'l.jsonl'}", f"--json={t / 'l.jsonl'}"],
                                   "--json={t}/l.jsonl is also an input of this command (--lambada={t}/l.jsonl)"),
    "--json= its --plot": (lambda t: [f"--json={t / 'c.png'}", f"--plot={t / 'c.png'}"],
                           "--json and --plot both name {t}/c.png; give each output its own path"),
    "--json= a run's log": (lambda t: [f"--json={t / 'cmp' / 'cwt' / 'log.jsonl'}"],
                            "--json={t}/cmp/cwt/log.jsonl lies inside {t}/cmp/cwt, which --out_dir writes"),
    "--seeds=1,2**32 (refused after seed 1's points)": (
        lambda t: ["--negatives_sweep=all", "--seeds=1,4294967296"], "--seeds must be in [0, 4294967295]"),
    "--seed=2**32": (lambda t: ["--seed=4294967296"], "--seed must be in [0, 4294967295]"),
    "--block_size=1e9": (lambda t: ["--block_size=1e9"], "--block_size must be in [2, 1048576], got 1000000000"),
    "--batch_size=1e9": (lambda t: ["--batch_size=1e9"], "--batch_size must be in [1, 1048576]"),
    "--seed with --seeds": (lambda t: ["--negatives_sweep=all", "--seeds=1", "--seed=5"],
                            "--seed=5 changes nothing with --seeds"),
    "an --out_dir holding --dataset": (lambda t: [f"--out_dir={t}"], "--out_dir={t}/ce would hold --dataset="),
}


@pytest.mark.parametrize("case", COMPARE_CASES)
def test_compare_refuses_each_case_before_any_work(case, tmp_path, monkeypatch, capsys):
    (tmp_path / "ce" / "d").mkdir(parents=True)
    (tmp_path / "ce" / "d" / "meta.json").write_text("{}")  # a dataset's folder, read by the last case only
    flags, words = COMPARE_CASES[case]
    argv = [f"--dataset={tmp_path / 'ce' / 'd'}", f"--out_dir={tmp_path / 'cmp'}", "--quick", "--device=cpu",
            *flags(tmp_path)]
    monkeypatch.setattr(compare, "train", lambda cfg: pytest.fail("trained before the refusal"))
    before = tree_state(tmp_path)
    err = refusal(compare.main, argv, monkeypatch, capsys)
    assert tree_state(tmp_path) == before and words.format(t=tmp_path) in err, err


def test_quick_fills_only_the_settings_not_given():
    """--quick replaced a given --block_size=16 with its own 32: the flag changed nothing."""
    cfg = cli.parse_flags(compare.CompareConfig, ["--quick", "--block_size=16"])
    assert (compare.with_quick(cfg).block_size, compare.with_quick(cfg).ce_iters) == (16, compare.QUICK["ce_iters"])


def test_a_signal_as_a_run_ends_stops_compare(tiny_data_dir, tmp_path, monkeypatch):
    """Ctrl-C during CE's last validation was swallowed by the run that just finished: compare.py went on with
    CWT and exited 0. The signal now reaches the command: CE is saved and finished, CWT never starts."""
    real = train.Run.validate

    def validate_then_ctrl_c(self):
        real(self)
        if self.state.step == self.cfg.max_iters:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(train.Run, "validate", validate_then_ctrl_c)
    cfg = compare.CompareConfig(dataset=str(tiny_data_dir), quick=True, out_dir=str(tmp_path / "cmp"), device="cpu")
    with pytest.raises(common.Interrupted) as stopped:
        compare.run_compare(cfg)
    assert stopped.value.signum == signal.SIGINT and sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["ce"]


@pytest.fixture(scope="module")
def finished_compare(tmp_path_factory):
    """A finished quick compare.py (CE, CWT, its fine-tune) on a 300-token BPE of two plays' speeches: its
    checkpoints are small, so that copies of its state are cheap. Returns (its flags, out_dir, result)."""
    import data
    import model

    root = tmp_path_factory.mktemp("state")
    speeches = [s for p in sources.play_files()[:2] for s in sources.clean_play(p.read_text()).split("\n\n")]
    (root / "src").mkdir()
    for name, part in (("train", speeches[:300]), ("validation", speeches[300:330])):
        (root / "src" / f"{name}.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in part))
    prepare.prepare(prepare.PrepareConfig(dataset=str(root / "src"), tokenizer="bpe:300", data_root=str(root / "data")))
    flags = [f"--dataset={data.dataset_dir(str(root / 'src'), str(root / 'data'), tokenizer='bpe:300')}", "--quick",
             "--device=cpu", f"--data_root={root / 'data'}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(model.PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))
        compare.main([*flags, f"--out_dir={root / 'out'}", f"--json={root / 'result.json'}"])
    return flags, root / "out", json.loads((root / "result.json").read_text())


def measured(result: dict) -> dict:
    """What a compare.py measured: its runs (but their time), curves, steps and budget."""
    return {"runs": {k: {**r, "seconds": None} for k, r in result["runs"].items()}, "curves": result["curves"],
            "iters": result["iters"], "budget_flops": result["budget_flops"]}


def damage(out: Path, how: str, run: str, name: str, where: float) -> None:
    """One change to a run's file in out: deleted, its bytes cut at `where` (a share of its length), or a value of
    a line (log.jsonl) or field (ckpt.safetensors) of the wrong type."""
    path = out / run / name
    if how == "delete":
        path.unlink()
    elif how == "cut":
        data = path.read_bytes()
        path.write_bytes(data[:int(where * len(data))])
    elif name == "log.jsonl":
        lines = path.read_text().splitlines()
        i = int(where * len(lines))
        record = json.loads(lines[i])
        key = sorted(record)[int(where * 100) % len(record)]
        record[key] = [str(record[key])] if int(where * 10) % 2 else str(record[key])
        path.write_text("\n".join([*lines[:i], json.dumps(record), *lines[i + 1:]]) + "\n")
    else:
        ckpt = read_ckpt(path)
        key = ("step", "val", "state", "loss", "tokens_seen")[int(where * 5)]
        ckpt[key] = "text"
        save_ckpt(ckpt, path)


STATE_CASES = {  # the cases (a traceback each): (run, file, how), what the one line says
    "a missing log.jsonl of a finished run": (("cwt", "log.jsonl", "delete"), "holds a finished run whose validation"),
    "a log.jsonl line of the wrong types": (("ce", "log.jsonl", "retype"), "log.jsonl line"),
    "a log.jsonl cut short": (("cwt-ft", "log.jsonl", "cut"), "holds a finished run whose validation"),
    "a checkpoint cut short": (("ce", "ckpt.safetensors", "cut"), "is not a valid safetensors file"),
}


@pytest.mark.parametrize("case", STATE_CASES)
def test_damaged_resume_state_is_one_line_before_any_run(case, finished_compare, tmp_path, monkeypatch, capsys):
    flags, out, _ = finished_compare
    shutil.copytree(out, tmp_path / "out")
    (run, name, how), words = STATE_CASES[case]
    damage(tmp_path / "out", how, run, name, 0.5)
    before = tree_state(tmp_path)
    err = refusal(compare.main, [*flags, f"--out_dir={tmp_path / 'out'}", "--resume"], monkeypatch, capsys)
    assert tree_state(tmp_path) == before and words in err, err


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.lists(st.tuples(st.sampled_from(["delete", "cut", "retype"]), st.sampled_from(compare.RUNS),
                                  st.sampled_from(["ckpt.safetensors", "log.jsonl"]), st.floats(0, 0.99)),
                        min_size=1, max_size=2))
def test_any_damage_to_the_resume_state_works_as_before_or_is_one_line(changes, finished_compare,
                                                                       tmp_path_factory, monkeypatch, capsys):
    """compare.py --resume over its out_dir with files deleted, cut short or given values of the wrong type:
    it gives the result of the undamaged run (a missing checkpoint's run is trained again, deterministically),
    or refuses in one line with exit 2 before any run starts, changing nothing; never a traceback."""
    flags, out, reference = finished_compare
    root = tmp_path_factory.mktemp("damaged")
    shutil.copytree(out, root / "out")
    for how, run, name, where in changes:
        if (root / "out" / run / name).exists():
            damage(root / "out", how, run, name, where)
    before = tree_state(root)
    monkeypatch.setattr(sys, "argv", ["compare.py", *flags, f"--out_dir={root / 'out'}", "--resume",
                                      f"--json={root / 'result.json'}"])
    capsys.readouterr()
    try:
        common.run_main(compare.main)
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code in (0, 2) and "Traceback" not in err, (code, err)
    if code == 2:
        assert one_error_line(err) and tree_state(root) == before, err
    else:
        result = json.loads((root / "result.json").read_text())
        assert measured(result) == measured(reference)
