"""analyze.py: every measure against a plain float64 reference on small matrices, the initialisation a checkpoint
records against its step-0 weights, and the command end to end on tiny CE, CWT, fine-tuned and encoder runs."""
import itertools
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import refused_before_any_work
from helpers import read_ckpt, run_cli, save_ckpt, tiny_config
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays
from safetensors.torch import save_file

import analyze
import checkpoint
import common
import data
import train
from data import open_split
from finetune import FinetuneConfig, finetune
from model import GPT, PRESETS, GPTConfig
from tokenizer import load_tokenizer

# ----------------------------------------------------------------------------------------------
# The measures against plain references


def pairwise_mean_cosine(rows: np.ndarray) -> float:
    """The definition, pair by pair (a zero row's cosine counts 0)."""
    norms = [np.linalg.norm(r) for r in rows]
    cosines = [rows[i] @ rows[j] / (norms[i] * norms[j]) if norms[i] and norms[j] else 0.0
               for i, j in itertools.permutations(range(len(rows)), 2)]
    return float(np.mean(cosines))


def svd_effective_rank(rows: np.ndarray) -> float:
    s = np.linalg.svd(rows, compute_uv=False)
    p = s[s > 0] / s.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


def test_anisotropy_is_the_mean_cosine_over_every_pair():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(9, 5)) + np.array([2.0, 0, 0, 0, 0])  # a common direction: clearly anisotropic
    rows[3] = 0.0
    got = analyze.anisotropy(torch.from_numpy(rows))
    assert got == pytest.approx(pairwise_mean_cosine(rows), abs=1e-12) and got > 0.3
    assert analyze.anisotropy(torch.eye(4)) == 0.0  # orthogonal rows
    assert analyze.anisotropy(torch.ones(3, 2)) == pytest.approx(1.0)
    assert analyze.anisotropy(torch.tensor([[1.0, 0.0], [-1.0, 0.0]])) == pytest.approx(-1.0)
    assert analyze.anisotropy(torch.ones(1, 3)) is None  # no pair


def test_effective_rank_matches_an_svd_reference():
    rng = np.random.default_rng(1)
    for rows in (rng.normal(size=(20, 6)), rng.normal(size=(4, 9)), np.outer(rng.normal(size=7), rng.normal(size=3))):
        got = analyze.effective_rank(analyze.singular_values(torch.from_numpy(rows)))
        assert got == pytest.approx(svd_effective_rank(rows), rel=1e-9)
    assert analyze.effective_rank(analyze.singular_values(torch.eye(5))) == pytest.approx(5.0)
    assert analyze.effective_rank(analyze.singular_values(torch.zeros(3, 3))) is None


finite_rows = arrays(np.float64, st.tuples(st.integers(2, 7), st.integers(1, 5)),
                     elements=st.floats(-10, 10, allow_nan=False).filter(lambda v: v == 0 or abs(v) > 1e-3))


@settings(max_examples=25, deadline=None)
@given(rows=finite_rows, scales=st.lists(st.floats(1e-3, 1e3), min_size=7, max_size=7), seed=st.integers(0, 99))
def test_anisotropy_ignores_row_scale_and_order_and_stays_in_range(rows, scales, seed):
    base = analyze.anisotropy(torch.from_numpy(rows))
    scaled = rows * np.array(scales[:len(rows)])[:, None]
    shuffled = scaled[np.random.default_rng(seed).permutation(len(rows))]
    assert analyze.anisotropy(torch.from_numpy(shuffled)) == pytest.approx(base, abs=1e-9)
    assert -1 - 1e-9 <= base <= 1 + 1e-9
    assert base == pytest.approx(pairwise_mean_cosine(rows), abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(rows=finite_rows)
def test_effective_rank_lies_between_1_and_min_n_d(rows):
    got = analyze.effective_rank(analyze.singular_values(torch.from_numpy(rows)))
    if not rows.any():
        assert got is None
        return
    assert 1 - 1e-9 <= got <= min(rows.shape) + 1e-9
    assert got == pytest.approx(svd_effective_rank(rows), rel=1e-9)


def test_token_counts_in_chunks_are_a_plain_count(tmp_path):
    values = np.random.default_rng(2).integers(0, 50, size=1001).astype(np.uint16)
    values.tofile(tmp_path / "train.bin")
    tokens = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="r")
    expected = np.array([int((values == i).sum()) for i in range(60)])
    for chunk in (1, 7, 1000, 1 << 20):
        assert analyze.token_counts(tokens, 60, chunk).tolist() == expected.tolist()


def plain_read_counts(tokens: np.ndarray, vocab: int, starts, width: int) -> np.ndarray:
    return np.bincount(np.concatenate([tokens[s:s + width] for s in starts] or [tokens[:0]]), minlength=vocab)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 99), windows=st.integers(0, 30), width=st.integers(1, 40), chunk=st.integers(1, 300))
def test_read_counts_in_chunks_are_a_count_over_every_window(seed, windows, width, chunk):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50, size=257).astype(np.uint16)
    starts = rng.integers(0, len(tokens) - width + 1, size=windows)  # overlapping and repeated windows count twice
    got = analyze.read_counts(tokens, 60, starts, width, chunk)
    assert got.tolist() == plain_read_counts(tokens, 60, starts, width).tolist()


def test_frequency_bins_by_hand():
    # ids:            0  1  2  3  4   5   6    7    8  9
    counts = np.array([0, 3, 0, 9, 10, 99, 100, 250, 1, 0])
    norms = torch.arange(10, dtype=torch.float64)  # the norm of id i is i
    drift = torch.arange(10, dtype=torch.float64) / 10
    targets = torch.tensor([0, 2, 1, 1, 4, 6, 7, 7, 3])
    row_ce = torch.tensor([1.0, 3.0, 2.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], dtype=torch.float64)
    bins = analyze.frequency_bins(counts, norms, drift, targets, row_ce)
    assert [(b["min_count"], b["max_count"], b["tokens"]) for b in bins] == [(0, 0, 3), (1, 9, 3), (10, 99, 2),
                                                                          (100, 250, 2)]
    assert [b["mean_norm"] for b in bins] == pytest.approx([(0 + 2 + 9) / 3, (1 + 3 + 8) / 3, 4.5, 6.5])
    assert [b["mean_drift"] for b in bins] == pytest.approx([1.1 / 3, 1.2 / 3, 0.45, 0.65])
    assert [b["val_positions"] for b in bins] == [2, 3, 1, 3]
    assert [b["val_ce"] for b in bins] == pytest.approx([2.0, (2 + 4 + 9) / 3, 5.0, 7.0])
    assert analyze.frequency_bins(counts, norms, None, targets[:0], row_ce[:0])[1]["val_ce"] is None
    assert analyze.count_edges(5) == [1, 2, 6]  # at least two bins of seen tokens
    assert analyze.count_edges(12345) == [1, 10, 100, 1000, 10000, 12346]


def test_drift_against_a_known_initialisation():
    config = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=8, lm_head=False, causal=True)
    init = checkpoint.Init(seed=7, model_config=GPTConfig(**config))
    start = analyze.initial_model(init).wte.weight.detach().double()
    torch.manual_seed(7)
    assert torch.equal(GPT(GPTConfig(**config)).wte.weight.double(), start)  # as train.py draws it
    moved = start.clone()
    moved[3] += torch.tensor([3.0, 4, 0, 0, 0, 0, 0, 0])  # 5 away
    moved[10] *= 0.5  # half its norm away
    drift, drift_from, note = analyze.distance_from_init(checkpoint.Checkpoint({}, init.model_config, init=init),
                                                         moved[:60])
    expected = torch.zeros(60, dtype=torch.float64)
    expected[3], expected[10] = 5.0, 0.5 * start[10].norm()
    assert torch.allclose(drift, expected, atol=1e-12) and drift_from == "seed 7" and note is None
    imported = checkpoint.Checkpoint({}, init.model_config)  # no init: an import, or older
    assert analyze.distance_from_init(imported, moved)[0] is None
    assert "cannot be rebuilt" in analyze.distance_from_init(imported, moved)[2]


def test_nearest_neighbours_are_a_plain_cosine_ranking():
    table = torch.from_numpy(np.random.default_rng(3).normal(size=(30, 4)))
    ids = torch.tensor([1, 2, 5, 8, 13, 21, 29])
    unit = lambda v: v / np.linalg.norm(v)  # noqa: E731
    ranked = sorted((i for i in ids.tolist() if i != 5), key=lambda i: -unit(table[i].numpy()) @ unit(table[5].numpy()))
    assert analyze.nearest_neighbours(table, ids, 5, k=3) == ranked[:3]


def test_a_word_is_one_token_with_a_leading_space_or_bare_else_none():
    tok = load_tokenizer("gpt2")
    assert analyze.word_token(tok, "king") == tok.encode_ordinary(" king")[0]
    assert analyze.word_token(tok, ",") == tok.encode_ordinary(" ,")[0]
    assert analyze.word_token(tok, "antidisestablishmentarianism") is None


def test_isoscore_when_installed():
    pytest.importorskip("IsoScore")
    rng = np.random.default_rng(4)
    assert analyze.isoscore(torch.from_numpy(rng.normal(size=(4000, 4)))) > 0.95  # isotropic
    line = np.outer(rng.normal(size=500), [1.0, 2, 3]) + 1e-6 * rng.normal(size=(500, 3))
    assert analyze.isoscore(torch.from_numpy(line)) < 0.05  # one direction


# ----------------------------------------------------------------------------------------------
# The initialisation a checkpoint records, and the command end to end


@pytest.fixture(scope="module")
def runs(tiny_data_dir, tmp_path_factory):
    """Tiny checkpoints of the shrunk preset: CWT saved at step 0, then resumed to step 2, its head fine-tune, CE, an
    encoder, and one as written before checkpoints recorded their initialisation."""
    root = tmp_path_factory.mktemp("analyze")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "tiny", dict(n_layer=2, n_head=2, d_model=64, block_size=64))
        fast = dict(max_iters=2, eval_interval=2, eval_batches=1, batch_size=4)
        run = train.Run(tiny_config(tiny_data_dir, root / "cwt", **fast))
        with common.StopFlag() as stop:
            run.save(stop)
        (root / "step0").mkdir()
        shutil.copy(root / "cwt" / "ckpt.safetensors", root / "step0" / "ckpt.safetensors")
        train.train(tiny_config(tiny_data_dir, root / "cwt", resume=True, **fast))
        finetune(FinetuneConfig(ckpt=str(root / "cwt" / "ckpt.safetensors"), out_dir=str(root / "ft"), max_iters=2,
                                eval_interval=2, device="cpu", data_root=str(tiny_data_dir.parent)))
        train.train(tiny_config(tiny_data_dir, root / "ce", loss="ce", seed=1, **fast))
        train.train(tiny_config(tiny_data_dir, root / "mlm", objective="mlm", **fast))
    old = read_ckpt(root / "ce" / "ckpt.safetensors")
    del old["init"]
    (root / "old").mkdir()
    save_ckpt(old, root / "old" / "ckpt.safetensors")
    return root


def load(path):
    return checkpoint.load_checkpoint(path, train.TrainConfig)


def test_the_init_a_checkpoint_records_rebuilds_its_step0_weights_and_travels_with_its_lineage(runs):
    step0 = load(runs / "step0" / "ckpt.safetensors")
    assert step0.state.step == 0 and step0.init.seed == 0
    rebuilt = analyze.initial_model(step0.init).state_dict()
    assert rebuilt.keys() == step0.model.keys()
    assert all(torch.equal(rebuilt[k], step0.model[k]) for k in rebuilt)  # exactly, every weight
    cwt, ft, ce = (load(runs / name / "ckpt.safetensors") for name in ("cwt", "ft", "ce"))
    assert cwt.state.step == 2 and cwt.init == step0.init  # resumed from step 0: its lineage's
    assert ft.init == cwt.init and ft.model_config.lm_head and not ft.init.model_config.lm_head
    assert ce.init.seed == 1 and ce.init.model_config == cwt.init.model_config


@pytest.fixture(scope="module")
def analysed(runs, tiny_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("analysed")
    names = ("step0", "cwt", "ft", "ce", "mlm", "old")
    flags = [f"--ckpts={','.join(str(runs / n / 'ckpt.safetensors') for n in names)}", "--tokens=100", "--device=cpu",
             "--words=king,love,antidisestablishmentarianism", f"--json={out / 'analysis.json'}",
             f"--data_root={tiny_data_dir.parent}"]
    return dict(zip(names, analyze.main(flags))), out


ROW_KEYS = {"ckpt", "loss", "step", "tokens", "embedding_anisotropy", "embedding_anisotropy_all", "hidden_anisotropy",
            "embedding_effective_rank", "hidden_effective_rank", "embedding_isoscore", "hidden_isoscore",
            "frequency_bins", "neighbours", "ce_through", "masking", "drift_from", "drift_note"}


def test_rows_hold_every_measure(analysed, runs, tiny_data_dir):
    rows, out = analysed
    assert [r["ckpt"] for r in json.loads((out / "analysis.json").read_text())] == [
        str(runs / n / "ckpt.safetensors") for n in rows]
    counts = np.bincount(np.fromfile(tiny_data_dir / "train.bin", dtype=np.uint16), minlength=50257)
    for name, r in rows.items():
        assert r.keys() >= ROW_KEYS, name
        assert r["positions"] == 100 and r["split_ids"] == int((counts > 0).sum()), name
        assert r["train_tokens"] == int(counts.sum()) and r["counts_from"] == "tokens read in training", name
        assert [b["tokens"] for b in r["split_frequency_bins"]][0] == int((counts == 0).sum())
        assert r["read_ids"] == 50257 - r["frequency_bins"][0]["tokens"] and r["read_ids"] < r["split_ids"], name
        for bins in (r["frequency_bins"], r["split_frequency_bins"]):
            assert sum(b["tokens"] for b in bins) == 50257  # every id of the tokenizer, no padding
        assert sum(b["val_positions"] for b in r["frequency_bins"]) == 100
        weighted = sum(b["val_ce"] * b["val_positions"] for b in r["frequency_bins"] if b["val_positions"]) / 100
        assert weighted == pytest.approx(r["val_ce"], rel=1e-9)  # the bins split the positions
        assert name == "step0" or 1 <= r["embedding_effective_rank"] <= 64  # step 0 read no token
        assert 1 <= r["hidden_effective_rank"] <= 64
        assert -1 <= r["hidden_anisotropy"] <= 1
        assert len(r["embedding_singular_values"]) == min(64, r["read_ids"])
    assert rows["cwt"]["step"] == 2 and rows["cwt"]["tokens"] == 2 * 4 * 32
    assert rows["cwt"]["read_tokens"] == 2 * 4 * 33 and rows["mlm"]["read_tokens"] == 2 * 4 * 32  # + last target
    assert rows["step0"]["read_ids"] == 0 and rows["step0"]["embedding_anisotropy"] is None  # nothing read yet
    assert rows["ft"]["tokens"] == 4 * 4 * 32 and rows["ft"]["objective"] == "ce head fine-tune"
    assert [rows[n]["ce_through"] for n in ("cwt", "ft", "ce")] == ["tied E", "lm_head", "tied E"]


def test_an_encoder_is_measured_with_masking_off(analysed):
    rows, _ = analysed
    assert rows["mlm"]["encoder"] and rows["mlm"]["masking"] == "off"
    assert rows["mlm"]["ce_target"] == "own token (masking off)"
    assert rows["cwt"]["masking"] is None and rows["cwt"]["ce_target"] == "next token"


def test_drift_is_zero_at_step0_from_the_pretraining_init_after_a_finetune_and_null_without_an_init(analysed, runs):
    rows, _ = analysed
    assert all(b["mean_drift"] == 0.0 for b in rows["step0"]["frequency_bins"] if b["tokens"])
    ft = load(runs / "ft" / "ckpt.safetensors")
    start = analyze.initial_model(ft.init).wte.weight.detach().double()[:50257]
    drift = (ft.model["wte.weight"].double()[:50257] - start).norm(dim=1)
    counts = analyze.token_counts(np.fromfile(Path(rows["ft"]["dataset"]) / "train.bin", dtype=np.uint16), 50257)
    for b in rows["ft"]["split_frequency_bins"]:
        in_bin = (counts >= b["min_count"]) & (counts <= b["max_count"])
        assert b["mean_drift"] == pytest.approx(drift[torch.from_numpy(in_bin)].mean().item(), rel=1e-9)
    assert rows["ft"]["drift_from"] == "seed 0" and rows["ft"]["frequency_bins"][-1]["mean_drift"] > 0
    assert rows["old"]["drift_from"] is None and "records no initialisation" in rows["old"]["drift_note"]
    assert all(b["mean_drift"] is None for b in rows["old"]["frequency_bins"])


def test_the_table_puts_checkpoints_side_by_side(analysed, capsys):
    rows, _ = analysed
    lines = list(analyze.table_lines(list(rows.values())))
    text = "\n".join(lines)
    header = next(line for line in lines if line.split() == list(rows))
    assert header and "anisotropy E (seen)" in text and "unseen" in text
    assert "'antidisestablishmentarianism' is not one token seen in training for step0, cwt" in text
    assert "'king' is not one token seen in training for step0, cwt, ft, ce, mlm, old" in text  # never read
    love = lines.index(next(line for line in lines if line.split() == ["love"]))
    assert len(lines[love + 1].split()) == 1 + len(rows)  # rank, then one neighbour per checkpoint
    assert "records no initialisation" in text and "different tokenizers" not in text
    other = [dict(rows["cwt"]), dict(rows["ce"], tokenizer="bpe:512", vocab_size=512)]
    assert "different tokenizers (bpe:512, gpt2): their measures are not over the same ids" in "\n".join(
        analyze.table_lines(other))


def test_the_plot(analysed, tmp_path):
    pytest.importorskip("matplotlib")
    rows, _ = analysed
    analyze.plot(list(rows.values()), str(tmp_path / "analysis.png"))
    assert (tmp_path / "analysis.png").read_bytes().startswith(b"\x89PNG")


def test_missing_or_non_checkpoint_files_are_one_line_before_any_work(runs, tmp_path, monkeypatch, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    save_file({"weights": torch.zeros(2)}, tmp_path / "other.pt")  # safetensors, but no checkpoint's
    good = runs / "cwt" / "ckpt.safetensors"
    for bad, message in [(tmp_path / "missing.pt", "missing.pt not found"),
                         (tmp_path / "notes.txt", "is not a safetensors file"),
                         (tmp_path / "other.pt", "is not a headless-lm checkpoint")]:
        code, out, err = run_cli(analyze.main, [f"--ckpts={good},{bad}", f"--json={tmp_path / 'a.json'}"],
                                 monkeypatch, capsys)
        assert code == 2 and err.startswith("error: ") and message in err and out == "", err
        assert not (tmp_path / "a.json").exists()


@pytest.mark.parametrize("flags, message", [
    (["--ckpts="], "--ckpts=A,B,... names the checkpoints"),
    (["--ckpts=CKPT,CKPT"], "lists OUT/base.pt more than once"),
    (["--ckpts=CKPT", "--tokens=0"], "--tokens must be in [2, 1048576], got 0"),
    (["--ckpts=CKPT", "--words=king,,love"], "--words has an empty word"),
    (["--ckpts=CKPT", "--json=OUT"], "is a directory; pass a file path"),
    (["--ckpts=CKPT", "--json=CKPT"], "is also an input of this command"),
    (["--ckpts=CKPT", "--json=OUT/a.json", "--plot=OUT/a.json"], "--json and --plot both name OUT/a.json"),
])
def test_bad_flags_are_refused_before_any_work(flags, message, tmp_path):
    refused_before_any_work(analyze.main, flags, message.replace("OUT", str(tmp_path)), tmp_path)


def test_optional_packages_missing_are_one_line(runs, tiny_data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, _, err = run_cli(analyze.main, [f"--ckpts={runs / 'cwt' / 'ckpt.safetensors'}",
                                          f"--plot={tmp_path / 'a.png'}", f"--data_root={tiny_data_dir.parent}"],
                           monkeypatch, capsys)
    assert code == 2 and err == "error: --plot needs matplotlib, an optional extra: pip install matplotlib"
    monkeypatch.setitem(sys.modules, "IsoScore", None)
    monkeypatch.setitem(sys.modules, "IsoScore.IsoScore", None)
    assert analyze.isoscore(torch.eye(3)) is None
    rows = analyze.main([f"--ckpts={runs / 'cwt' / 'ckpt.safetensors'}", "--tokens=40", "--device=cpu", "--words=",
                         f"--data_root={tiny_data_dir.parent}"])
    assert rows[0]["embedding_isoscore"] is None and rows[0]["hidden_isoscore"] is None
    assert "pip install isoscore" in capsys.readouterr().err


def test_every_row_is_valid_json_without_nan(analysed):
    _, out = analysed
    for row in json.loads((out / "analysis.json").read_text(), parse_constant=lambda c: pytest.fail(c)):
        assert row["read_ids"] == 0 or math.isfinite(row["embedding_anisotropy"])  # none at step 0: nothing read
        assert math.isfinite(row["hidden_effective_rank"])


def test_the_read_counts_are_the_tokens_training_read(tiny_data_dir, tmp_path, monkeypatch):
    """Every batch the real sampler hands the loop, recorded while a run trains (two micro-batches a step), is
    resumed with more steps, and fine-tuned: the counts analyze.py rebuilds from each checkpoint are those."""
    monkeypatch.setitem(PRESETS, "tiny", dict(n_layer=1, n_head=2, d_model=32, block_size=64))
    read = []
    real_get = data.BatchSampler.get

    def recording(sampler, index):
        x, y = real_get(sampler, index)
        read.append(torch.cat([x, y[:, -1:]], dim=1).flatten().numpy())  # the inputs, and the last target
        return x, y

    monkeypatch.setattr(data.BatchSampler, "get", recording)
    fast = dict(eval_interval=10, eval_batches=1, batch_size=3, block_size=16, grad_accum=2, seed=5)
    train.train(tiny_config(tiny_data_dir, tmp_path / "cwt", max_iters=2, **fast))
    train.train(tiny_config(tiny_data_dir, tmp_path / "cwt", max_iters=3, resume=True, **fast))
    after_pretraining = len(read)
    finetune(FinetuneConfig(ckpt=str(tmp_path / "cwt" / "ckpt.safetensors"), out_dir=str(tmp_path / "ft"), max_iters=2,
                            eval_interval=2, device="cpu", data_root=str(tiny_data_dir.parent)))
    tokens = open_split(tiny_data_dir, "train", 50304)
    for name, batches in (("cwt", read[:after_pretraining]), ("ft", read)):
        recorded = np.bincount(np.concatenate(batches), minlength=50257)
        got, why = analyze.lineage_read_counts(load(tmp_path / name / "ckpt.safetensors"), tokens, 50257, causal=True)
        assert why is None and got.tolist() == recorded.tolist(), name
    assert after_pretraining == 6 and len(read) == 10  # 3 steps of 2 micro-batches, then 2 more steps
    other_seed = load(tmp_path / "ft" / "ckpt.safetensors")
    other_seed.train_config["seed"] = 6  # as after a --seed=6 fine-tune: its reads are not one stream
    got, why = analyze.lineage_read_counts(other_seed, tokens, 50257, causal=True)
    assert got is None and "its lineage changed seed" in why
