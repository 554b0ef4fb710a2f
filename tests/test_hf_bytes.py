"""Bytes per token of the Hugging Face tokenizer kinds (hf.py), measured in context from the tokens' offsets:
every kind sums to the text's UTF-8 bytes, whatever it does to spaces, accents or unknown characters, and
its non-special added tokens are text (their CE counts); then bits per byte on data prepared with each."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from test_bytes import TEXTS
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

import bpe
import data
import prepare
import sources
import train
from hf import HFTokenizer
from model import build_model

CORPUS = ["the cat sat on the mat", "a    b  c", "café crème brûlée", "中文字 and 😀 emoji", "line\n\nbreaks\tand tabs"]


def byte_level_with_added_tokens() -> Tokenizer:
    """A byte-level BPE (as GPT-2's and Pythia's) with whitespace runs added as non-special tokens (Pythia's
    tokenizer has such) and end-of-text as a special one."""
    tok = bpe.train_bpe(CORPUS * 4, 300)
    tok.add_tokens([AddedToken("  ", special=False, normalized=False), AddedToken("    ", special=False,
                                                                                  normalized=False)])
    return tok


def wordpiece() -> Tokenizer:
    """BERT's kind: lowercased, accents stripped, spaces dropped, word pieces marked ##."""
    vocab = {t: i for i, t in enumerate(["[UNK]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "a", "b",
                                         "##e", "##s", "c", "##a", "##t", "ca", "##f", "."])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[SEP]", "[MASK]"])
    return tok


def sentencepiece_style() -> Tokenizer:
    """Metaspace ("▁" where a word starts) and byte fallback (a character without a piece becomes its
    bytes, <0xE4><0xB8><0xAD>), as Llama's tokenizer."""
    pieces = ["<unk>", "</s>", "▁", "▁the", "▁cat", "t", "h", "e", "c", "a"]
    vocab = {p: i for i, p in enumerate(pieces)}
    vocab.update({f"<0x{b:02X}>": len(pieces) + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["</s>"])
    return tok


KINDS = {"byte-level + added": byte_level_with_added_tokens, "bpe:N": lambda: bpe.train_bpe(CORPUS * 4, 280),
         "wordpiece": wordpiece, "sentencepiece": sentencepiece_style}


@pytest.fixture(scope="module")
def tokenizers_by_kind() -> dict[str, HFTokenizer]:
    return {kind: HFTokenizer(kind, make()) for kind, make in KINDS.items()}


@settings(max_examples=40, deadline=None)
@given(TEXTS)
def test_every_kind_counts_the_bytes_of_the_text(tokenizers_by_kind, text):
    for kind, enc in tokenizers_by_kind.items():
        [(ids, counts)] = enc.encode_with_bytes([text])
        assert ids.tolist() == enc.encode_ordinary(text), kind
        if len(ids):  # a text that is all dropped (WordPiece: only spaces) has no token to stand for it
            assert int(counts.sum()) == len(text.encode()), (kind, text)


@pytest.mark.parametrize("kind, text, n_bytes", [
    ("byte-level + added", "a    b", 6),  # was 2: the added whitespace tokens counted as special
    ("sentencepiece", "the cat\n", 8),  # was 12: "▁" counted as 3 bytes, and byte pieces twice
    ("wordpiece", "the cafe", 8),  # "##e" was 3 bytes; the dropped space counts with "ca"
])
def test_the_reviews_cases(tokenizers_by_kind, kind, text, n_bytes):
    enc = tokenizers_by_kind[kind]
    [(ids, counts)] = enc.encode_with_bytes([text])
    assert int(counts.sum()) == n_bytes == len(text.encode())


def test_added_tokens_that_are_not_special_are_text(tokenizers_by_kind):
    enc = tokenizers_by_kind["byte-level + added"]
    whitespace = [enc.encode_ordinary(s) for s in ("  ", "    ")]
    assert all(len(ids) == 1 and ids[0] not in enc.special_ids for ids in whitespace)
    assert enc.special_ids == [enc.eot_token]


@pytest.mark.parametrize("kind", ["byte-level + added", "wordpiece", "sentencepiece"])
def test_bits_per_byte_of_data_prepared_with_each_kind(kind, tokenizers_by_kind, tmp_path):
    """val_bpb over one window of the val split equals the float64 CE in bits of its non-special targets over
    the bytes of their text; val.bytes sums to the val documents' UTF-8 bytes."""
    path = tmp_path / kind.replace(" ", "") / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(tokenizers_by_kind[kind].json)
    cfg = prepare.PrepareConfig(dataset="shakespeare", tokenizer=str(path), max_docs=4, val_fraction=0.25,
                             data_root=str(tmp_path / "data"), name="plays")
    meta = prepare.prepare(cfg)
    folder = tmp_path / "data" / "plays"
    val = data.open_val_split(folder, meta["vocab_size"])
    plays = [sources.clean_play(p.read_text(encoding="utf-8")) for p in sources.play_files()[:4]]
    held_out = [p for p in plays if data.split_by_hash([p], 0.25).__next__()[0] == "val"]
    assert int(val.byte_counts.sum()) == meta["val_bytes"] == sum(len(p.encode()) for p in held_out)
    n = 128
    tokens = np.asarray(val.tokens[:n + 1]).astype(np.int64)
    torch.manual_seed(0)
    model = build_model("tiny", meta["vocab_size"], block_size=n, n_layer=1, d_model=32, n_head=2).double()
    objective = train.Objective(model, train.LossConfig(loss="ce"))
    got = train.evaluate(objective, train.ValSplit(tokens, val.byte_counts[:n + 1], val.special),
                         train.Validation(batch_size=1, block_size=n))["val_bpb"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(tokens[None, :-1]))[0].double(), dim=-1)
    bits = -sum(logp[t, y].item() for t, y in enumerate(tokens[1:].tolist()) if y not in val.special)
    assert got == pytest.approx(bits / math.log(2) / int(val.byte_counts[1:n + 1].sum()), rel=1e-9)
