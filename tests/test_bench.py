"""bench.py: the speed/memory grid, its FLOP estimates, and the data pipeline benchmark."""
from __future__ import annotations

import json
import statistics
import sys

import pytest
from conftest import refused_before_any_work
from helpers import io_pairs, refusal, tree_state

import bench
import checkpoint
import checkpoint_format
import cli
import doors
import train
from common import UserError


def test_variant_names():
    assert bench.parse_variant("ce") == dict(loss="ce", negatives="all", num_negatives=None, chunk_size=None)
    assert bench.parse_variant("cwt-unique-k64") == dict(loss="cwt", negatives="unique", num_negatives=64,
                                                         chunk_size=None)
    assert bench.parse_variant("ce-chunk256") == dict(loss="ce", negatives="all", num_negatives=None,
                                                      chunk_size=256)
    for bad in ("ce-unique", "cwt-k", "nce", "cwt-all", "cwt-chunk0", "cwt-chunk"):
        with pytest.raises(UserError, match="unknown variant"):
            bench.parse_variant(bad)


def test_quick_grid_rows_are_consistent(tmp_path):
    cfg = bench.BenchConfig(preset="tiny", vocab=[2048], tokens=[128], step_tokens=[64], block_size=32,
                            variants=["ce", "cwt", "cwt-unique", "cwt-k16"], step_variants=["ce", "cwt"],
                            warmup=1, repeats=2, memory=False, device="cpu")
    result = bench.run_bench(cfg)
    rows = result["rows"]
    assert [(r["kind"], r["variant"]) for r in rows] == [("loss", "ce"), ("loss", "cwt"),
                                                         ("loss", "cwt-unique"), ("loss", "cwt-k16"),
                                                         ("step", "ce"), ("step", "cwt"),
                                                         ("mlm", "ce"), ("mlm", "cwt")]
    for r in rows:
        assert len(r["times_s"]) == 2 and r["time_s"] == statistics.median(r["times_s"]) > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["time_s"])
        ce = next(c for c in rows if c["kind"] == r["kind"] and c["variant"] == "ce")
        assert r["time_ratio"] == pytest.approx(r["time_s"] / ce["time_s"])
        assert r["best_ratio"] == pytest.approx(min(r["times_s"]) / min(ce["times_s"]))
        assert r["memory_bytes"] is None and r["mfu"] is None
    flops = {(r["kind"], r["variant"]): r["flops"] for r in rows}
    d, n, v = 128, 128, 2048  # tiny: d_model 128; loss layer: 6 FLOPs per token, per d, per scored column
    assert flops["loss", "ce"] == 6 * n * d * v
    assert flops["loss", "cwt"] == 6 * n * d * n
    assert flops["loss", "cwt-k16"] == 6 * n * d * 17
    assert flops["loss", "cwt-unique"] <= flops["loss", "cwt"]
    # Full step, tiny shape: 4 blocks of 12 d^2 weights, 9 d biases and 2 LayerNorms (2 d each), a final
    # LayerNorm; T = 32, 64 tokens.
    body = 4 * (12 * d * d + 9 * d + 4 * d) + 2 * d
    per_token = lambda cols: 6 * body + 12 * 4 * d * 32 + 6 * d * cols  # noqa: E731
    assert flops["step", "ce"] == 64 * per_token(2048)
    assert flops["step", "cwt"] == 64 * per_token(64)
    # MLM step: the same body; only the masked positions (round(0.15 x 32) = 5 of each 32-token row) are
    # scored, against V for CE and against those 2 x 5 masked positions for CWT
    assert flops["mlm", "ce"] == 64 * per_token(0) + 6 * d * 10 * 2048
    assert flops["mlm", "cwt"] == 64 * per_token(0) + 6 * d * 10 * 10
    table = bench.markdown_table(result)
    assert table.count("\n| loss |") == 4 and "time ×CE" in table
    bench.save_results(result, str(tmp_path / "b.json"), "", bench.plot_bench)
    assert json.loads((tmp_path / "b.json").read_text())["rows"][0]["variant"] == "ce"


def test_cpu_memory_is_measured_in_a_fresh_process():
    spec = dict(kind="loss", preset="tiny", vocab=32768, tokens=256, block_size=256, seed=0, device="cpu",
                dtype="auto", variants=["ce", "cwt"])
    memory = bench.measure_memory(spec, bench.pick_device("cpu"))
    ce, cwt = memory["ce"], memory["cwt"]
    # CE holds 256 x 32768 fp32 logits (32 MiB) and their gradient; CWT only 256 x 256 scores.
    assert ce > 32 * 2**20 and ce > cwt > 0


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(UserError, match="pip install matplotlib"):
        bench.import_pyplot()
    with pytest.raises(UserError, match="optional extra"):  # refused before any measurement
        bench.main(["--quick", f"--plot={tmp_path / 'b.png'}"])


def test_bench_quick_fills_only_unset_flags():
    cfg = cli.parse_flags(bench.BenchConfig, ["--quick", "--repeats=5", "--vocab=1024"], quick=bench.QUICK)
    assert (cfg.repeats, cfg.vocab, cfg.preset, cfg.tokens) == (5, [1024], "tiny", [512])
    assert cli.parse_flags(bench.BenchConfig, ["--repeats=5"], quick=bench.QUICK).preset == "pythia-70m"


def test_too_many_negatives_are_reported_once(capsys):
    cfg = bench.BenchConfig(variants=["ce", "cwt-k256", "cwt-k64"], tokens=[128, 1024])
    bench.warn_if_every_negative(cfg)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cwt-k256 at 128 tokens" in err and "k64" not in err


@pytest.mark.parametrize("flags, message", [
    (["--repeats=0"], "--repeats must be in [1, 1000000], got 0"),
    (["--tokens=256,0"], "--tokens must be in [1, 4194304], got 0"),
    (["--json=OUT"], "is a directory"),
])
def test_bad_numbers_are_refused_before_any_work(flags, message, tmp_path):
    refused_before_any_work(bench.main, flags, message, tmp_path)


# ------------------------------------------------------------- issue 33: contracts 1, 5, 6

SMALL = ["--mode=loss", "--preset=tiny", "--vocab=64", "--tokens=8", "--variants=ce", "--repeats=1", "--warmup=0",
         "--memory=false", "--device=cpu"]


def a_dataset(t):
    (t / "d").mkdir()
    (t / "d" / "meta.json").write_text(json.dumps({"format": 3, "tokenizer": "gpt2"}, indent=2) + "\n")
    return t / "d" / "meta.json"


BENCH_CASES = {  # case: (flags given tmp_path; what the one line says)
    "--json= a dataset's meta.json": (lambda t: [*SMALL, f"--json={a_dataset(t)}"],
                                      "--json={t}/d/meta.json exists and is not results (a JSON table or list) as "
                                      "this project writes them"),
    "--gpu_check --json": (lambda t: ["--gpu_check", f"--json={t / 'r.json'}"],
                           "--json={t}/r.json changes nothing with --gpu_check"),
    "--gpu_check --quick": (lambda t: ["--gpu_check", "--quick"], "--quick=True changes nothing with --gpu_check"),
    "--mode=ddp --json": (lambda t: ["--mode=ddp", f"--json={t / 'r.json'}"], "changes nothing with --mode=ddp"),
    "--mode=data --preset": (lambda t: ["--mode=data", "--preset=tiny"], "--preset=tiny changes nothing with "
                             "--mode=data"),
    "--variants with --mode=step": (lambda t: ["--mode=step", "--variants=cwt"], "--variants=cwt changes nothing"),
    "--check_presets without --gpu_check": (lambda t: ["--check_presets=tiny"], "changes nothing without --gpu_check"),
    "--variants=ce,ce": (lambda t: [*SMALL, "--variants=ce,ce"], "--variants lists ce more than once"),
    "--variants=cwt-k0 (all negatives, silently)": (lambda t: [*SMALL, "--variants=cwt-k0"],
                                                    "unknown variant 'cwt-k0'"),
    "variants = [] in a config file": (
        lambda t: (t / "c.json").write_text('{"variants": []}') and [*SMALL[:4], f"--config={t / 'c.json'}"],
        "--variants needs at least one value"),
    "--vocab=1e12": (lambda t: [*SMALL, "--vocab=1e12"], "--vocab must be in [2, 4194304]"),
    "--tokens=1e9": (lambda t: [*SMALL, "--tokens=1e9"], "--tokens must be in [1, 4194304]"),
    "--block_size=1e9": (lambda t: ["--mode=step", "--block_size=1e9"], "--block_size must be in [1, 1048576]"),
}


@pytest.mark.parametrize("case", BENCH_CASES)
def test_bench_refuses_each_case_before_any_work(case, tmp_path, monkeypatch, capsys):
    flags, words = BENCH_CASES[case]
    argv = flags(tmp_path)
    for work in ("run_bench", "gpu_check", "bench_data", "bench_ddp"):
        monkeypatch.setattr(bench, work, lambda *a: pytest.fail("worked before the refusal"))
    before = tree_state(tmp_path)
    err = refusal(bench.main, argv, monkeypatch, capsys)
    assert tree_state(tmp_path) == before and words.format(t=tmp_path) in err, err


def test_bench_never_writes_over_into_or_around_its_inputs(tmp_path_factory, monkeypatch, capsys):
    """Contract 1, generated (helpers.io_pairs): --json and --plot against --chunked_ref and --config."""
    io_pairs({"bench --chunked_ref": (bench.main, "file", ("same", "link", "link_parent", "hardlink"), "r.png",
                                      lambda i, o: [*SMALL, f"--chunked_ref={i}", f"--plot={o}"]),
              "bench --config": (bench.main, "config", ("same", "link", "link_parent", "hardlink"), "c.json",
                                 lambda i, o: [*SMALL, f"--config={i}", f"--json={o}"])})(
        tmp_path_factory, monkeypatch, capsys)


def test_the_checkpoint_mode_loads_one_payload_both_ways(tmp_path, monkeypatch):
    """--mode=checkpoint compares like with like: what its door gives back from ckpt.safetensors is what plain
    torch.load gives back from the torch.save file of the same payload (weights, every AdamW state tensor)."""
    import torch

    monkeypatch.setitem(bench.PRESETS, "tiny", dict(n_layer=1, n_head=2, d_model=16, block_size=64))
    payload = bench.checkpoint_payload("tiny", vocab=64)
    checkpoint.save_checkpoint(tmp_path / "ckpt.safetensors", payload)
    torch.save(doors.plain(payload), tmp_path / "ckpt.pt")
    ours = checkpoint.load_checkpoint(tmp_path / "ckpt.safetensors", train.TrainConfig)
    checkpoint_format.resumable(tmp_path / "ckpt.safetensors", ours)
    plain = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ours.model.keys() == plain["model"].keys() and len(plain["optimizer"]["state"]) > 0
    assert all(torch.equal(ours.model[k], t) for k, t in plain["model"].items())
    for pid, entry in plain["optimizer"]["state"].items():
        assert all(torch.equal(ours.optimizer["state"][pid][k], t) for k, t in entry.items())
    with pytest.raises(UserError, match="--vocab=.* changes nothing with --mode=checkpoint"):
        bench.main(["--mode=checkpoint", "--vocab=64"])
