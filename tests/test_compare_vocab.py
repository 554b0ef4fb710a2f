"""compare.py --vocab_sizes: CE vs CWT + fine-tune once per BPE size, in bits per byte on the same text."""
from __future__ import annotations

import json
import math
import sys

import pytest
from helpers import WRONG_JSON, damaged_json
from hypothesis import given, settings, strategies as st

import compare
import data
import model
import sources
from common import UserError

SIZES = (300, 400)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The quick sweep over a small local source with its own splits (1,000 speeches of two plays to train on,
    100 held out: ~10k validation tokens), each BPE dataset prepared by the sweep itself, with the `tiny`
    preset shrunk as small_tiny_preset does."""
    root = tmp_path_factory.mktemp("vocab")
    speeches = [s for p in sources.play_files()[:2] for s in sources.clean_play(p.read_text()).split("\n\n")]
    (root / "src").mkdir()
    for name, part in (("train", speeches[:1000]), ("validation", speeches[1000:1100])):
        (root / "src" / f"{name}.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in part))
    cfg = compare.CompareConfig(dataset=str(root / "src"), vocab_sizes=list(reversed(SIZES)), quick=True,
                                data_root=str(root / "data"), out_dir=str(root / "out"), device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(model.PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))
        result = compare.run_vocab_sweep(cfg)
    return cfg, result


def test_sweep_scores_every_size_in_bits_per_byte_on_the_same_text(sweep):
    cfg, result = sweep
    sizes = result["sizes"]
    assert [r["bpe"] for r in sizes] == list(SIZES)
    for r in sizes:
        meta = data.load_meta(r["data_dir"])
        assert meta["tokenizer"] == f"bpe:{r['bpe']}" and meta["documents"] == 1100
        assert r["data_dir"] == str(data.dataset_dir(cfg.dataset, cfg.data_root, tokenizer=f"bpe:{r['bpe']}"))
        assert set(r["full_val"]) == {"ce", "cwt", "cwt-ft"}
        for scores in r["full_val"].values():
            assert math.isfinite(scores["val_bpb"]) and scores["val_bpb"] > 0
        block = r["config"]["block_size"]
        assert r["full_val"]["ce"]["tokens"] == (meta["val_tokens"] - 1) // block * block  # all whole blocks
        assert "out_dir" not in r["sweep_settings"] and r["sweep_settings"]["ce_iters"] == cfg.ce_iters
    # the same held-out speeches at both sizes: the bytes scored differ only by the last partial block
    b300, b400 = (r["full_val"]["ce"]["bytes"] for r in sizes)
    assert abs(b300 - b400) < 0.01 * b300
    table = compare.vocab_table(result)
    assert "val_bpb CE" in table and "val_bpb CWT + ft" in table and "same held-out documents" in table
    for r in sizes:
        line = next(line for line in table.splitlines() if line.startswith(f"| {r['bpe']} |"))
        assert f"{r['full_val']['ce']['val_bpb']:.4f}" in line and f"{r['full_val']['cwt-ft']['val_bpb']:.4f}" in line
    for n in SIZES:  # each size's results, written once it finished
        assert json.loads((compare.Path(cfg.out_dir) / f"bpe{n}" / "result.json").read_text())["bpe"] == n


def test_rerun_skips_finished_sizes(sweep, monkeypatch):
    cfg, first = sweep
    calls = []
    monkeypatch.setattr(compare, "run_compare", lambda c: calls.append(c) or pytest.fail("a finished size ran"))
    again = compare.run_vocab_sweep(cfg)
    assert calls == [] and [(r["bpe"], r["full_val"]) for r in again["sizes"]] == \
        [(r["bpe"], r["full_val"]) for r in first["sizes"]]
    # an interrupted sweep: the last size has no result.json yet, so only it runs
    done = compare.Path(cfg.out_dir) / "bpe400" / "result.json"
    saved = json.loads(done.read_text())
    done.unlink()
    prepared = compare.Path(saved["data_dir"]) / "meta.json"
    mtime = prepared.stat().st_mtime_ns
    monkeypatch.setattr(compare, "run_compare", lambda c: calls.append(c) or saved)
    resumed = compare.run_vocab_sweep(cfg)
    assert [c.out_dir for c in calls] == [str(done.parent)] and done.is_file()
    assert resumed["sizes"][1]["full_val"] == first["sizes"][1]["full_val"]
    assert prepared.stat().st_mtime_ns == mtime  # the dataset is prepared once
    # a run stopped early (Ctrl-C saves and returns): that size is not recorded as finished
    done.unlink()
    monkeypatch.setattr(compare, "run_compare", lambda c: {**saved, "iters": {**saved["iters"], "cwt": 10**6}})
    with pytest.raises(UserError, match="bpe:400 was interrupted .cwt at step"):
        compare.run_vocab_sweep(cfg)
    assert not done.exists()


def test_finished_size_with_other_settings_is_refused(sweep):
    cfg, _ = sweep
    with pytest.raises(UserError, match="other settings.*ce_iters"):
        compare.run_vocab_sweep(compare.dataclasses.replace(cfg, ce_iters=3, quick=False))
    broken = compare.Path(cfg.out_dir) / "broken"
    (broken / "bpe300").mkdir(parents=True)
    (broken / "bpe300" / "result.json").write_text("{")
    with pytest.raises(UserError, match="not a finished size"):
        compare.run_vocab_sweep(compare.dataclasses.replace(cfg, out_dir=str(broken)))


def test_bad_sizes_prepared_folders_and_plots_without_matplotlib_are_one_line(tiny_data_dir, tmp_path,
                                                                                  monkeypatch):
    with pytest.raises(UserError, match="from 257 to"):
        compare.run_vocab_sweep(compare.CompareConfig(vocab_sizes=[1024, 100], out_dir=str(tmp_path)))
    with pytest.raises(UserError, match="prepared dataset"):
        compare.run_vocab_sweep(compare.CompareConfig(vocab_sizes=[1024], dataset=str(tiny_data_dir),
                                                      out_dir=str(tmp_path)))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(UserError, match="optional extra") as e:
        compare.main(["--vocab_sizes=1024", f"--out_dir={tmp_path}", f"--plot={tmp_path / 'vocab.png'}"])
    assert "\n" not in str(e.value)
    assert not any(tmp_path.iterdir())  # refused before any work


@settings(max_examples=30, deadline=None, derandomize=True)
@given(how=st.sampled_from(["retype", "delete", "cut"]), where=st.floats(0, 0.999), wrong=st.sampled_from(WRONG_JSON))
def test_a_damaged_size_result_is_used_as_before_or_refused_in_one_line(sweep, tmp_path_factory, how, where, wrong):
    """The door of a size's result.json (doors.results_file) under random damage: refused in one line, or what
    it lets in tables as a finished size does (vocab_table, finite JSON), never a traceback."""
    cfg, _ = sweep
    good = json.loads((compare.Path(cfg.out_dir) / "bpe300" / "result.json").read_text())
    path = tmp_path_factory.mktemp("size") / "result.json"
    path.write_text(damaged_json(good, how, where, wrong))
    try:
        result = compare.finished_size(path, good["sweep_settings"], "size", {"bpe": 300})
    except UserError as e:
        assert "\n" not in str(e) and len(str(e)) < 1000
        return
    compare.vocab_table({"sizes": [result]})
    json.dumps(result["full_val"], allow_nan=False)
