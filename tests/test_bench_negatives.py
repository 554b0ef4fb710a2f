"""bench.py --negatives_sweep: step time and memory of CWT as its negatives grow (k sampled, unique, all), CE beside."""
from __future__ import annotations

import json
from unittest import mock

import pytest
from conftest import refused_before_any_work

import bench
from cli import parse_flags

KEYS = {"kind", "label", "variant", "loss", "negatives", "num_negatives", "vocab_size", "tokens", "preset", "step_ms",
        "best_ms", "peak_mib", "flops", "time_vs_all", "memory_vs_all", "time_vs_ce", "memory_vs_ce"}


def test_rows_for_each_entry_with_ratios_to_all_and_to_ce(small_tiny_preset, one_thread, monkeypatch):
    monkeypatch.setattr(bench, "measure_memory", lambda spec, device: {v: 2**20 * (i + 1)
                                                                       for i, v in enumerate(spec["variants"])})
    cfg = bench.BenchConfig(negatives_sweep=["all", "16", "unique"], preset="tiny", vocab=[1024], step_tokens=[64],
                            block_size=32, repeats=1, warmup=0, device="cpu")
    rows = bench.run_negatives_sweep(cfg)
    assert [(r["kind"], r["label"]) for r in rows] == [(k, label) for k in ("loss", "step")
                                                       for label in ("CE", "k=16", "unique", "all")]
    for r in rows:
        assert r.keys() >= KEYS and r["tokens"] == 64 and r["vocab_size"] == 1024 and r["step_ms"] > 0
        same = {b["label"]: b for b in rows if b["kind"] == r["kind"]}
        assert r["time_vs_all"] == pytest.approx(r["step_ms"] / same["all"]["step_ms"])
        assert r["time_vs_ce"] == pytest.approx(r["step_ms"] / same["CE"]["step_ms"])
        assert r["memory_vs_all"] == pytest.approx(r["peak_mib"] / 4) and r["memory_vs_ce"] == r["peak_mib"]
    assert [(r["loss"], r["negatives"], r["num_negatives"]) for r in rows[:4]] == [
        ("ce", None, None), ("cwt", "all", 16), ("cwt", "unique", None), ("cwt", "all", None)]
    # k sampled negatives: each row scores k + 1 candidates, not the 64 of the micro-batch
    assert rows[1]["flops"] == 6 * 64 * 64 * 17 and rows[3]["flops"] == 6 * 64 * 64 * 64  # loss rows, d = 64
    table = bench.negatives_table(rows)
    assert table.count("\n| loss |") == 4 and table.count("\n| step |") == 4 and "time ×all" in table


def test_ce_above_max_logits_is_left_out_and_cwt_still_measured(small_tiny_preset, one_thread, capsys, tmp_path):
    out = tmp_path / "negatives.json"
    bench.main(["--negatives_sweep=8,all", "--mode=loss", "--preset=tiny", "--vocab=1024", "--step_tokens=64",
                f"--max_logits={64 * 1024 - 1}", "--repeats=1", "--warmup=0", "--memory=false", f"--json={out}"])
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and [r["label"] for r in rows] == ["k=8", "all"]
    assert all(r["time_vs_ce"] is None and r["memory_vs_all"] is None for r in rows)
    assert "CE not measured (tokens x V above --max_logits=65535" in capsys.readouterr().err


def test_quick_is_the_tiny_shape_on_a_micro_batch_of_1024_tokens():
    cfg = parse_flags(bench.BenchConfig, ["--negatives_sweep=64,256,unique,all", "--quick"],
                      quick=bench.QUICK_NEGATIVES)
    assert (cfg.preset, cfg.vocab, cfg.step_tokens, cfg.block_size) == ("tiny", [50304], [1024], 128)
    assert bench.negatives_variants(cfg.negatives_sweep, 1024) == ["cwt-k64", "cwt-k256", "cwt-unique", "cwt"]
    assert all(n * v <= cfg.max_logits for n in cfg.step_tokens for v in cfg.vocab)  # CE measured beside


@pytest.mark.parametrize("flags, message", [
    (["--negatives_sweep=0,64"], "k=0 scores no negative"),
    (["--negatives_sweep=64,1024"], "k=1024 is not below the 1024 candidates"),  # --quick: 8 x 128
    (["--negatives_sweep="], "--negatives_sweep needs values"),
    (["--negatives_sweep=64,,all"], "--negatives_sweep needs values"),
    (["--negatives_sweep=64,1e3"], "'1e3' is not a number of negatives k, unique or all"),
    (["--negatives_sweep=64,all,64"], "lists k=64 more than once"),
    (["--negatives_sweep=all,ALL,all"], "'ALL' is not a number"),
    (["--negatives_sweep=64", "--mode=mlm"], "--negatives_sweep measures loss and step rows"),
    (["--negatives_sweep=64", "--vocab_sweep=1024"], "two sweeps: pass one"),
])
def test_bad_values_are_refused_in_one_line_before_any_work(flags, message, tmp_path):
    refused_before_any_work(bench.main, ["--quick", f"--json={tmp_path / 'out.json'}", *flags], message, tmp_path)


def test_plot_draws_time_and_memory_per_entry_with_ce_levels(tmp_path, monkeypatch):
    rows = [dict(kind="step", label=label, loss="ce" if label == "CE" else "cwt", vocab_size=1024, tokens=64,
                 step_ms=t, peak_mib=m, preset="tiny", device="cpu", dtype="float32")
            for label, t, m in (("CE", 9.0, 5.0), ("k=16", 2.0, 1.0), ("unique", 3.0, None), ("all", 4.0, 2.0))]
    plt = mock.MagicMock()
    axes = [mock.MagicMock(), mock.MagicMock()]
    plt.subplots.return_value = (mock.MagicMock(), axes)
    monkeypatch.setattr(bench, "import_pyplot", lambda: plt)
    bench.plot_negatives_sweep(rows, str(tmp_path / "negatives.png"))
    assert axes[0].plot.call_args.args == ((0, 1, 2), (2.0, 3.0, 4.0))
    assert axes[1].plot.call_args.args == ((0, 2), (1.0, 2.0))  # memory where it was measured
    assert axes[0].axhline.call_args.args == (9.0,) and axes[1].axhline.call_args.args == (5.0,)
    assert (tmp_path / "negatives.png").exists()
