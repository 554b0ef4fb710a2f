"""bench.py --vocab_sweep (CE vs CWT across vocabulary sizes) and --mode=val (validation's peak memory)."""
from __future__ import annotations

import json
import math
import re
import sys

import pytest

import bench
from cli import parse_flags
from common import UserError

KEYS = {"kind", "loss", "vocab_size", "tokens", "preset", "step_ms", "best_ms", "peak_mib", "time_vs_smallest",
        "memory_vs_smallest", "time_vs_ce", "memory_vs_ce"}


def test_vocab_sweep_rows_and_ratios(capsys):
    cfg = bench.BenchConfig(vocab_sweep=[4096, 1024], preset="tiny", step_tokens=[64], block_size=32, repeats=2,
                            memory=False, device="cpu")
    rows = bench.run_vocab_sweep(cfg)
    assert len(rows) == 8  # {loss, step} x {ce, cwt} x 2 sizes
    assert {(r["kind"], r["loss"], r["vocab_size"]) for r in rows} == {
        (k, loss, v) for k in ("loss", "step") for loss in ("ce", "cwt") for v in (1024, 4096)}
    for r in rows:
        assert r.keys() >= KEYS and r["tokens"] == 64 and r["preset"] == "tiny" and r["step_ms"] > 0
        smallest = next(b for b in rows if (b["kind"], b["loss"], b["vocab_size"]) == (r["kind"], r["loss"], 1024))
        ce = next(b for b in rows if (b["kind"], b["loss"], b["vocab_size"]) == (r["kind"], "ce", r["vocab_size"]))
        assert r["time_vs_smallest"] == pytest.approx(r["step_ms"] / smallest["step_ms"])
        assert r["time_vs_ce"] == pytest.approx(r["step_ms"] / ce["step_ms"])
        assert r["peak_mib"] is r["memory_vs_smallest"] is r["memory_vs_ce"] is None  # memory=False
    assert all(r["time_vs_smallest"] == 1 for r in rows if r["vocab_size"] == 1024)
    table = bench.sweep_table(rows)
    assert table.count("\n| loss |") == 4 and table.count("\n| step |") == 4 and "time ×smallest V" in table


def test_vocab_sweep_json_is_a_list_of_rows_with_memory(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    bench.main(["--vocab_sweep=1024,4096", "--mode=step", "--preset=tiny", "--step_tokens=64", "--block_size=32",
                "--repeats=1", "--warmup=0", f"--json={out}"])
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and [(r["kind"], r["loss"], r["vocab_size"]) for r in rows] == [
        ("step", "ce", 1024), ("step", "cwt", 1024), ("step", "ce", 4096), ("step", "cwt", 4096)]
    for r in rows:
        assert r.keys() >= KEYS and r["peak_mib"] > 0  # measured in a fresh process per configuration (Linux)
        smallest = next(b for b in rows if (b["loss"], b["vocab_size"]) == (r["loss"], 1024))
        ce = next(b for b in rows if (b["loss"], b["vocab_size"]) == ("ce", r["vocab_size"]))
        assert r["memory_vs_smallest"] == pytest.approx(r["peak_mib"] / smallest["peak_mib"])
        assert r["memory_vs_ce"] == pytest.approx(r["peak_mib"] / ce["peak_mib"])
    assert capsys.readouterr().out.count("\n| step |") == 4


def test_quick_sweep_shape_measures_every_size():
    cfg = parse_flags(bench.BenchConfig, ["--vocab_sweep=8192,32768,65536,131072,262144", "--quick"],
                      quick=bench.QUICK_SWEEP)
    assert cfg.preset == "tiny" and cfg.step_tokens == [256]
    assert all(n * v <= cfg.max_logits for n in cfg.step_tokens for v in cfg.vocab_sweep)  # none skipped


def test_vocab_sweep_bad_input_is_one_line(monkeypatch, tmp_path):
    with pytest.raises(UserError, match="--vocab_sweep measures loss and step rows"):
        bench.main(["--vocab_sweep=1024", "--mode=mlm"])
    with pytest.raises(UserError, match=re.escape("--vocab_sweep must be in [2, 4194304], got 1")):
        bench.main(["--vocab_sweep=1024,1"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(UserError, match="optional extra") as e:  # refused before any measurement
        bench.main(["--vocab_sweep=1024,2048", "--quick", f"--plot={tmp_path / 'sweep.png'}"])
    assert "\n" not in str(e.value)


def test_val_mode_measures_one_pass_whole_and_chunked(capsys):
    cfg = bench.BenchConfig(mode="val", preset="tiny", vocab=[8192], step_tokens=[256], block_size=64,
                            step_variants=["ce", "cwt"], val_chunk=32, warmup=0, repeats=1, device="cpu")
    result = bench.run_bench(cfg)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["ce", "ce-chunk32", "cwt", "cwt-chunk32"]
    for name, r in rows.items():
        assert r["kind"] == "val" and r["batch_size"] == 4 and r["block_size"] == 64 and r["time_s"] > 0
        whole = rows[name.split("-")[0]]
        assert r["chunk_size"] == (32 if "chunk" in name else None)
        assert r["memory_vs_unchunked"] == pytest.approx(r["memory_bytes"] / whole["memory_bytes"])
    # whole: 256 x 8192 fp32 logits (8 MiB) and their log-softmax; in chunks of 32 rows, 1 MiB tiles
    assert rows["ce"]["memory_bytes"] > 8 * 2**20
    assert rows["ce-chunk32"]["memory_bytes"] < rows["ce"]["memory_bytes"] / 4
    assert rows["cwt-chunk32"]["memory_bytes"] < rows["cwt"]["memory_bytes"] / 2
    summary = bench.val_summary(result)
    assert summary.count("\n") == 1 and "in chunks of 32 rows" in summary
    assert math.isfinite(rows["cwt"]["flops"]) and rows["cwt"]["flops"] > rows["ce"]["flops"]


def test_val_mode_refuses_sampled_negatives():
    assert bench.val_variants(["cwt", "ce-chunk64"], 128) == ["cwt", "cwt-chunk128", "ce-chunk64"]
    with pytest.raises(UserError, match="every in-batch candidate"):
        bench.val_variants(["cwt-unique"], 128)
