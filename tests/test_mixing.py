"""mixing.py: several datasets in one run (--dataset=A,B --mix_alpha), and a multilingual-style encoder on a
WordPiece tokenizer with its own [MASK]."""
from __future__ import annotations

import json
import math
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import read_ckpt
from hypothesis import given, settings, strategies as st

import data
import mixing
import prepare
import train
from common import UserError

pytestmark = pytest.mark.usefixtures("small_tiny_preset")


def write_language(folder: Path, letters: str, docs: int, seed: int) -> Path:
    """A made-up language: lines of words over its own letters, one document per .txt file."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    for i in range(docs):
        lines = [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 6))) for _ in range(10))
                 for _ in range(20)]
        (folder / f"doc{i:03d}.txt").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def languages(tmp_path_factory) -> tuple[Path, list[str]]:
    """Two prepared datasets of different sizes (GPT-2 tokens): a big one and a small one."""
    root = tmp_path_factory.mktemp("langs")
    names = []
    for name, letters, docs in (("big", "abcdefgh", 40), ("small", "stuvwxyz", 10)):
        source = write_language(root / "sources" / name, letters, docs, seed=len(name))
        prepare.prepare(prepare.PrepareConfig(dataset=str(source), val_fraction=0.3, data_root=str(root)))
        names.append(name)
    return root, names


def config(root: Path, out: Path, **overrides) -> train.TrainConfig:
    settings = dict(dataset="big,small", data_root=str(root), preset="tiny", block_size=16, batch_size=4,
                    max_iters=6, warmup_iters=1, lr_schedule="constant", eval_interval=3, eval_batches=2,
                    log_interval=1, out_dir=str(out), device="cpu", seed=0, mix_alpha=0.5)
    return train.TrainConfig(**{**settings, **overrides})


def test_probabilities_follow_the_alpha_formula_and_the_draws_follow_them(languages):
    assert mixing.mix_probabilities([900, 100], 1.0) == pytest.approx([0.9, 0.1])
    assert mixing.mix_probabilities([900, 100], 0.5) == pytest.approx([30 / 40, 10 / 40])  # sqrt: 30 and 10
    p = mixing.mix_probabilities([1000, 10, 1], 0.3)
    expected = np.array([1000, 10, 1]) ** 0.3
    assert p == pytest.approx(list(expected / expected.sum()))
    assert mixing.mix_probabilities([10**9, 10**6], 1000.0) == pytest.approx([1.0, 0.0])  # 1e9^1000 overflows
    root, names = languages
    cfg = config(root, root / "unused")
    sampler = mixing.MixedSampler([root / n for n in names], cfg, 16, 50304, "cpu")
    tokens = [data.load_meta(root / n)["train_tokens"] for n in names]
    assert sampler.probabilities == pytest.approx(mixing.mix_probabilities(tokens, 0.5))
    draws = np.bincount([sampler.source(i) for i in range(20_000)], minlength=2) / 20_000
    assert draws == pytest.approx(sampler.probabilities, abs=0.015)
    assert [sampler.source(i) for i in range(50)] == [sampler.source(i) for i in range(50)]  # a pure function
    # a batch comes from the source drawn for its index, and is that source's batch of the same index
    i = next(i for i in range(100) if sampler.source(i) == 1)
    assert torch.equal(sampler.get(i)[0], sampler.samplers[1].get(i)[0])


def test_a_mixed_run_validates_each_source_and_resumes_exactly(languages, tmp_path):
    root, _ = languages
    straight = train.train(config(root, tmp_path / "a"))
    val = straight["val"]
    assert val["val_ce"] == pytest.approx((val["val_ce_big"] + val["val_ce_small"]) / 2)  # unweighted mean
    assert {"val_cwt_big", "val_acc_small", "val_bpb_big"} <= set(val)
    ckpt = read_ckpt(tmp_path / "a" / "ckpt.safetensors")
    assert set(ckpt["mix"]) == {"big", "small"} and sum(ckpt["mix"].values()) == pytest.approx(1.0)
    train.train(config(root, tmp_path / "b", max_iters=3))
    train.train(config(root, tmp_path / "b", resume=True))
    losses = lambda d: {r["step"]: r["loss"] for r in map(json.loads, (d / "log.jsonl").read_text().splitlines())  # noqa: E731
                        if "loss" in r}
    assert losses(tmp_path / "b") == losses(tmp_path / "a")


@pytest.mark.parametrize("overrides, message", [
    (dict(mix_alpha=0.0), r"--mix_alpha must be in \(0, 100\], got 0.0"),
    (dict(mix_alpha=-1.0), r"--mix_alpha must be in \(0, 100\], got -1.0"),
    (dict(dataset="big,other"), "mixes datasets of different tokenizers"),
    (dict(dataset="big,big"), "names two sources of the same folder name"),
])
def test_bad_mixes_are_one_line(languages, tmp_path, overrides, message):
    root, _ = languages
    if "other" in overrides.get("dataset", ""):  # the same kind of text, another vocabulary
        source = write_language(tmp_path / "other", "abcdefgh", 12, seed=9)
        prepare.prepare(prepare.PrepareConfig(dataset=str(source), tokenizer="bpe:300", name="other",
                                        val_fraction=0.3, data_root=str(root)))
    with pytest.raises(UserError, match=message) as e:
        train.train(config(root, tmp_path / "out", **overrides))
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def wordpiece(path: Path) -> Path:
    """A small WordPiece tokenizer.json (BERT's kind: [CLS] [SEP] [MASK] ..., ## continuations)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {t: i for i, t in enumerate(specials + list(letters) + ["##" + c for c in letters])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(str(path))
    return path


def test_an_encoder_on_a_wordpiece_mix_masks_with_its_own_mask_id(tmp_path):
    tokenizer = wordpiece(tmp_path / "wordpiece.json")
    for name, letters in (("xx", "abcdefgh"), ("yy", "stuvwxyz")):
        source = write_language(tmp_path / "sources" / name, letters, 12, seed=len(letters) + ord(name[0]))
        meta = prepare.prepare(prepare.PrepareConfig(dataset=str(source), tokenizer=str(tokenizer), name=name,
                                               val_fraction=0.3, data_root=str(tmp_path / "data")))
    assert (meta["eot_token"], meta["mask_token"], meta["special_tokens"]) == (3, 4, [0, 1, 2, 3, 4])
    summary = train.train(train.TrainConfig(
        dataset="xx,yy", data_root=str(tmp_path / "data"), objective="mlm", preset="tiny", block_size=16,
        batch_size=4, max_iters=3, eval_interval=3, eval_batches=1, out_dir=str(tmp_path / "mlm"), device="cpu"))
    assert summary["step"] == 3 and "val_ce_xx" in summary["val"]
    ckpt = read_ckpt(tmp_path / "mlm" / "ckpt.safetensors")
    assert ckpt["mask_spec"]["mask_token"] == 4 and ckpt["tokenizer_json"]  # its own [MASK], carried along
    assert list(ckpt["mask_spec"]["special_tokens"]) == [0, 1, 2, 3, 4]


def test_a_mixed_runs_perplexity_is_that_of_its_mean_ce(languages, tmp_path):
    """val_ppl beside val_ce means exp(val_ce), for a mix as for one source (it was the mean of the sources'
    perplexities, which is larger)."""
    root, _ = languages
    val = train.train(config(root, tmp_path, max_iters=2, eval_interval=2))["val"]
    assert val["val_ppl"] == pytest.approx(math.exp(val["val_ce"]), rel=1e-12)
    assert val["val_ppl_big"] == pytest.approx(math.exp(val["val_ce_big"]), rel=1e-12)


@settings(max_examples=3, deadline=None)
@given(alpha=st.sampled_from([0.3, 1.0, 2.5]))
def test_the_fine_tune_draws_its_sources_as_the_pre_training_did(languages, alpha):
    """Shares p ~ size^alpha, in pre-training and in its fine-tune, which inherits --mix_alpha (it drew
    0.826 / 0.174 after a pre-training at alpha 1.0: 0.995 / 0.005)."""
    from finetune import FinetuneConfig, finetune

    root, names = languages
    out = Path(tempfile.mkdtemp())
    sizes = [data.load_meta(root / n)["train_tokens"] for n in names]
    expected = np.array(sizes, dtype=np.float64) ** alpha
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(__import__("model").PRESETS, "tiny", dict(n_layer=1, n_head=2, d_model=32, block_size=64))
        train.train(config(root, out / "pre", max_iters=1, eval_interval=1, eval_batches=1, mix_alpha=alpha))
        finetune(FinetuneConfig(ckpt=str(out / "pre" / "ckpt.safetensors"), data_root=str(root),
                                out_dir=str(out / "ft"), max_iters=1, eval_batches=1, device="cpu"))
    for run in ("pre", "ft"):
        mix = read_ckpt(out / run / "ckpt.safetensors")["mix"]
        assert [mix[n] for n in names] == pytest.approx(list(expected / expected.sum()), rel=1e-9), run
