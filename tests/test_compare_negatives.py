"""compare.py --negatives_sweep: CWT with k sampled, unique or all negatives at a fixed batch, and with all
negatives as the batch grows, each point beside CE at the same batch and tokens, scored on the whole val split."""
from __future__ import annotations

import json
import math
from unittest import mock

import pytest
from conftest import refused_before_any_work
from helpers import WRONG_JSON, damaged_json
from hypothesis import given, settings, strategies as st

import bench
import compare
import data
import model
import prepare
import sources
from common import UserError

FLAGS = ["--quick", "--negatives_sweep=all,8,unique", "--negatives_batch_sizes=4,2", "--seeds=7", "--device=cpu"]
POINTS = ["b2-ce-s7", "b2-cwt-k8-s7", "b2-cwt-unique-s7", "b2-cwt-s7", "b4-ce-s7", "b4-cwt-s7"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, one_thread):
    """The quick sweep (2 x 32 tokens a micro-batch, 2 steps) with the `tiny` preset shrunk as small_tiny_preset
    does, on a small local source tokenised with a 300-token BPE: the whole validation split (30 speeches) is
    scored in a moment, where GPT-2's 50k columns would take most of the time. The cost of a step goes through
    bench.py with stand-in timings and memory (bench's own tests measure them). One torch thread: a model this
    small only loses time to threads, badly so on a busy machine."""
    root = tmp_path_factory.mktemp("negatives")
    speeches = [s for p in sources.play_files()[:2] for s in sources.clean_play(p.read_text()).split("\n\n")]
    (root / "src").mkdir()
    for name, part in (("train", speeches[:300]), ("validation", speeches[300:330])):
        (root / "src" / f"{name}.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in part))
    prepare.prepare(prepare.PrepareConfig(dataset=str(root / "src"), tokenizer="bpe:300", data_root=str(root / "data")))
    data_dir = data.dataset_dir(str(root / "src"), str(root / "data"), tokenizer="bpe:300")
    argv = [*FLAGS, f"--dataset={data_dir}", f"--data_root={root / 'data'}", f"--out_dir={root / 'out'}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(model.PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))
        mp.setattr(bench, "time_interleaved", lambda steps, warmup, repeats, device: {
            v: [1e-3 * (i + 1)] for i, v in enumerate(steps)})
        mp.setattr(bench, "measure_memory", lambda spec, device: {v: 2**20 * (i + 1)
                                                                  for i, v in enumerate(spec["variants"])})
        compare.main([*argv, f"--json={root / 'rows.json'}"])
    return argv, root / "out", json.loads((root / "rows.json").read_text()), data_dir


def test_both_series_side_by_side_with_tokens_flops_and_cost(sweep):
    _, out, rows, data_dir = sweep
    assert [(r["series"], r["batch_size"], r["label"]) for r in rows] == [
        ("k", 2, "CE"), ("k", 2, "k=8"), ("k", 2, "unique"), ("k", 2, "all"),
        ("batch", 2, "CE"), ("batch", 2, "all"), ("batch", 4, "CE"), ("batch", 4, "all")]
    assert sorted(p.name for p in out.iterdir()) == sorted(POINTS)  # a point in both series ran once
    for r in rows:
        ce = next(b for b in rows if (b["series"], b["batch_size"], b["label"]) == (r["series"], r["batch_size"], "CE"))
        assert r["tokens"] == ce["tokens"] == r["batch_size"] * 32 * 3  # 2 steps + 1 of fine-tune, CE 3 steps
        assert r["block_size"] == 32 and r["seeds"] == [7] and r["flops"] > 0 and r["val_bpb_std"] is None
        assert math.isfinite(r["val_ce"]) and math.isfinite(r["val_bpb"])
        assert r["per_seed"][0]["val_bpb"] == r["val_bpb"]
        if r["loss"] == "cwt":
            assert (r["steps"], r["ft_steps"]) == (2, 1)
            assert r["bpb_vs_ce"] == pytest.approx(r["val_bpb"] - ce["val_bpb"])
            assert r["raw_bpb_vs_ce"] == pytest.approx(r["raw_val_bpb"] - ce["val_bpb"])
        else:
            assert (r["steps"], r["ft_steps"]) == (3, 0) and r["bpb_vs_ce"] is None and r["raw_val_bpb"] is None
    by = {(r["batch_size"], r["label"]): r for r in rows}
    assert by[2, "k=8"]["candidates"] == 9 and by[2, "all"]["candidates"] == 64 and by[4, "all"]["candidates"] == 128
    assert by[2, "CE"]["candidates"] == 320 and 1 < by[2, "unique"]["candidates"] < 64  # CE: BPE 300, padded
    assert [(r["negatives"], r["num_negatives"]) for r in rows[:4]] == [(None, None), ("all", 8), ("unique", None),
                                                                         ("all", None)]
    # the stand-ins, in the order bench.py measured each batch size's variants
    assert [v for r in rows for v in (r["step_ms"], r["peak_mib"])] == pytest.approx(
        [1, 1, 2, 2, 3, 3, 4, 4, 1, 1, 4, 4, 1, 1, 2, 2])  # flat: approx compares numbers, not nested lists
    shared = [r for r in rows if (r["batch_size"], r["label"]) == (2, "all")]
    assert {json.dumps({**r, "series": ""}) for r in shared} == {json.dumps({**shared[0], "series": ""})}
    result = json.loads((out / "b2-cwt-k8-s7" / "result.json").read_text())
    assert set(result["models"]) == {"cwt", "cwt-ft"} and result["models"]["cwt-ft"]["step"] == 1
    whole_blocks = (data.load_meta(data_dir)["val_tokens"] - 1) // 32 * 32  # all of the split but its last part
    assert result["models"]["cwt-ft"]["val_tokens"] == result["models"]["cwt"]["val_tokens"] == whole_blocks
    table = compare.negatives_table(rows)
    assert table.count("\n| k |") == 4 and table.count("\n| batch |") == 4 and "seeds 7 (n=1)" in table


def test_a_rerun_skips_finished_points_and_continues_an_unfinished_one(sweep, monkeypatch, capsys):
    argv, out, rows, _ = sweep
    monkeypatch.setattr(compare, "train", lambda cfg: pytest.fail("a finished run trained again"))
    monkeypatch.setattr(compare, "finetune", lambda cfg: pytest.fail("a finished run trained again"))
    monkeypatch.setattr(compare, "negatives_cost", lambda cfg, series, vocab: {})
    monkeypatch.setitem(model.PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))
    again = compare.run_negatives_sweep(compare.parse_flags(compare.CompareConfig, argv))
    err = capsys.readouterr().err
    assert all(f"{name}: finished earlier, skipped" in err for name in POINTS)
    assert [(r["label"], r["val_bpb"], r["tokens"]) for r in again] == [(r["label"], r["val_bpb"], r["tokens"])
                                                                          for r in rows]
    # a point stopped before its result.json: refused without --resume, then continued from its checkpoints
    done = out / "b2-cwt-k8-s7" / "result.json"
    before = json.loads(done.read_text())
    done.unlink()
    with pytest.raises(UserError, match=r"holds unfinished points of an earlier sweep \(b2-cwt-k8-s7\)"):
        compare.run_negatives_sweep(compare.parse_flags(compare.CompareConfig, argv))
    compare.run_negatives_sweep(compare.parse_flags(compare.CompareConfig, [*argv, "--resume"]))
    err = capsys.readouterr().err
    assert "b2-cwt-k8-s7: finished earlier" not in err and "b2-cwt-k8-s7/cwt-ft: finished earlier" in err
    assert sum(f"{name}: finished earlier, skipped" in err for name in POINTS) == len(POINTS) - 1
    after = json.loads(done.read_text())
    assert after["models"]["cwt-ft"]["val_bpb"] == before["models"]["cwt-ft"]["val_bpb"]
    # finished points made with other settings are another experiment
    with pytest.raises(UserError, match="other settings.*lr=0.001"):
        compare.run_negatives_sweep(compare.parse_flags(compare.CompareConfig, [*argv, "--lr=0.002"]))


def test_unique_counts_the_distinct_targets_of_the_runs_micro_batches(sweep):
    data_dir = sweep[3]
    cfg = compare.CompareConfig(batch_size=2, block_size=32, ce_iters=5, seed=3)
    unique = compare.scored_candidates(cfg, bench.parse_variant("cwt-unique"), data_dir, 320)
    sampler = data.BatchSampler(data.open_split(data_dir, "train", 320), 2, 32, 3)
    assert unique == pytest.approx(sum(len(set(sampler.get(i)[1].flatten().tolist())) for i in range(5)) / 5)
    assert 1 < unique < 64


def test_seeds_give_a_mean_and_a_spread_paired_with_ce():
    def result(seed, bpb, raw=None):
        models = {"cwt-ft" if raw else "ce": dict(val_ce=bpb * 2, val_bpb=bpb, tokens=96, flops=1e9, seconds=3.0)}
        if raw:
            models["cwt"] = dict(val_ce=raw * 2, val_bpb=raw, tokens=64, flops=5e8, seconds=2.0)
        return dict(seed=seed, steps=2, ft_steps=1, candidates=64, models=models, seconds=6.0)
    cfg = compare.CompareConfig(block_size=32)
    pairs = [(result(1, 2.0, raw=2.5), result(1, 1.9)), (result(2, 2.2, raw=2.4), result(2, 1.9))]
    row = compare.negatives_row(cfg, "k", 2, "cwt", pairs, {"step_ms": 5.0, "peak_mib": None, "device": "cpu"})
    assert row["seeds"] == [1, 2] and row["val_bpb"] == pytest.approx(2.1)
    assert row["val_bpb_std"] == pytest.approx(0.2 / math.sqrt(2))  # sample standard deviation
    assert row["bpb_vs_ce"] == pytest.approx(0.2) and row["raw_bpb_vs_ce"] == pytest.approx(0.55)
    assert row["tokens"] == 96 and row["seconds"] == 12.0 and row["lambada_acc"] is None
    line = compare.negatives_table([row]).splitlines()[2]
    assert "| 2.1000 ± 0.1414 |" in line and "| +0.2000 ± 0.1414 |" in line and "| 5.0 | - |" in line


@pytest.mark.parametrize("flags, message", [
    (["--negatives_sweep=0,all"], "k=0 scores no negative"),
    (["--negatives_sweep=8,64"], "k=64 is not below the 64 candidates of a micro-batch"),  # --quick: 2 x 32
    (["--negatives_sweep="], "--negatives_sweep needs values"),
    (["--negatives_sweep=8,,all"], "--negatives_sweep needs values"),
    (["--negatives_sweep=8,-3"], "'-3' is not a number of negatives k, unique or all"),
    (["--negatives_sweep=8,all,08"], "lists k=8 more than once"),
    (["--negatives_sweep=unique,unique"], "lists unique more than once"),
    (["--negatives_batch_sizes=4,4"], "--negatives_batch_sizes lists 4 more than once"),
    (["--negatives_batch_sizes=0,4"], "--negatives_batch_sizes must be in [1, 1048576]"),
    (["--negatives_sweep=8", "--seeds=1,2,1"], "--seeds lists 1 more than once"),
    (["--seeds=1,2"], "--seeds runs each point of --negatives_sweep"),
    (["--negatives_sweep=8", "--vocab_sizes=1024"], "two sweeps: pass one"),
])
def test_bad_values_are_refused_in_one_line_before_any_work(flags, message, tmp_path):
    refused_before_any_work(compare.main, ["--quick", "--out_dir=OUT/sweep", "--data_root=OUT/data", *flags],
                            message, tmp_path)


def test_plots_draw_both_series(tmp_path, monkeypatch):
    rows = [dict(series=s, loss=loss, label=label, batch_size=b, candidates=c, bpb_vs_ce=d, bpb_vs_ce_std=None,
                 raw_bpb_vs_ce=d, step_ms=5.0, peak_mib=p, preset="tiny", dataset="shakespeare", steps=2, ft_steps=1,
                 seeds=[1])
            for s, loss, label, b, c, d, p in (("k", "ce", "CE", 2, 320, None, 1.0),
                                               ("k", "cwt", "k=8", 2, 9, 0.1, 2.0),
                                               ("k", "cwt", "all", 2, 64, 0.05, None),
                                               ("batch", "cwt", "all", 4, 128, 0.02, 3.0))]
    plt = mock.MagicMock()
    quality, cost = mock.MagicMock(), mock.MagicMock()
    plt.subplots.return_value = (mock.MagicMock(), (quality, cost))
    monkeypatch.setattr(compare, "import_pyplot", lambda: plt)
    compare.plot_negatives_sweep(rows, str(tmp_path / "negatives.png"))
    drawn = [c.args for c in quality.errorbar.call_args_list]
    assert drawn == [([8, 63], [0.1, 0.05]), ([127], [0.02])]  # negatives per row: candidates - 1
    assert cost.twinx.return_value.plot.call_args_list[0].args[:2] == ([8], [2.0])  # memory where measured
    assert (tmp_path / "negatives.png").exists()


# ------------------------------------------------------------- issue 33: compare.py's state, its door


def test_a_result_json_copied_from_another_point_is_refused(sweep, tmp_path):
    """A point's result.json is used as it is on --resume: one of another point (or seed) would be tabled as
    this one's. Its batch, variant and seed must be the point's."""
    _, out, _, _ = sweep
    other = json.loads((out / "b2-cwt-k8-s7" / "result.json").read_text())
    (tmp_path / "result.json").write_text(json.dumps(other))
    with pytest.raises(UserError, match=r"result.json is not a finished point's results: variant is 'cwt-k8', not "
                                        r"'cwt-unique'; delete it to run that point again"):
        compare.finished_size(tmp_path / "result.json", other["sweep_settings"], "point",
                              {"batch_size": 2, "variant": "cwt-unique", "seed": 7})


@settings(max_examples=40, deadline=None, derandomize=True)
@given(how=st.sampled_from(["retype", "delete", "cut"]), where=st.floats(0, 0.999), wrong=st.sampled_from(WRONG_JSON))
def test_a_damaged_point_result_is_used_as_before_or_refused_in_one_line(sweep, tmp_path_factory, how, where, wrong):
    """The door of a point's result.json (doors.results_file), under random damage (a field of any other type,
    a field deleted, the file cut short): either it is refused in one line, or what it lets in tables as a
    finished point does (negatives_row, negatives_table, finite JSON), never a traceback."""
    _, out, _, _ = sweep
    good = json.loads((out / "b2-cwt-k8-s7" / "result.json").read_text())
    ce = json.loads((out / "b2-ce-s7" / "result.json").read_text())
    path = tmp_path_factory.mktemp("point") / "result.json"
    path.write_text(damaged_json(good, how, where, wrong))
    try:
        result = compare.finished_size(path, good["sweep_settings"], "point",
                                       {"batch_size": 2, "variant": "cwt-k8", "seed": 7})
    except UserError as e:
        assert "\n" not in str(e) and len(str(e)) < 1000
        return
    fields = compare.CompareConfig.__dataclass_fields__
    cfg = compare.CompareConfig(**{k: v for k, v in good["sweep_settings"].items() if k in fields})
    row = compare.negatives_row(cfg, "k", 2, "cwt-k8", [(result, ce)], {})
    compare.negatives_table([row])
    json.dumps(row, allow_nan=False)
