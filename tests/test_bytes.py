"""Bits per byte from the bytes recorded with the data: each token's UTF-8 bytes in its context, summing to
the text's own; val_bpb = (CE in bits over the non-special targets) / (the bytes those targets stand for).
GPT-2's tokenizer here; the Hugging Face kinds (byte-level BPE with added tokens, WordPiece, SentencePiece
style) are in test_hf_bytes.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from test_data import expected_splits

import data
import sources
import tokenizer
import train
from model import build_model

# Every kind of text a byte count can get wrong: runs of spaces, newlines, accents (one and two code points),
# CJK, emoji (4 bytes, and joined sequences), and "<|endoftext|>" written in the text (stays text).
PIECES = ["a", "the", " ", "  ", "    ", "\n", "\n\n", "\t", "é", "e\u0301", "ñ", "中", "文字", "😀", "👩‍💻", ".",
          "<|endoftext|>", "ß", "ﬁ", "\u00a0", "0", "42"]
TEXTS = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)


@settings(max_examples=60, deadline=None)
@given(TEXTS)
def test_gpt2_bytes_of_every_token_sum_to_the_text(text):
    enc = tokenizer.load_tokenizer("gpt2")
    [(ids, counts)] = tokenizer.encode_with_bytes(enc, [text])
    assert ids.tolist() == enc.encode_ordinary(text)
    assert int(counts.sum()) == len(text.encode())
    assert [len(enc.decode_single_token_bytes(i)) for i in ids.tolist()] == counts.tolist()


def test_val_bytes_hold_each_documents_bytes(tiny_data_dir):
    plays = [sources.clean_play(p.read_text(encoding="utf-8")) for p in sources.play_files()[:4]]
    val_docs = [p for p in plays if expected_splits([p], 0.25)[1]]
    meta = data.load_meta(tiny_data_dir)
    counts = data.open_val_split(tiny_data_dir, 50304).byte_counts
    tokens = data.open_split(tiny_data_dir, "val")
    assert meta["val_bytes"] == int(counts.sum()) == sum(len(d.encode()) for d in val_docs)
    assert counts[tokens == 50256].tolist() == [0] * len(val_docs)  # end-of-text stands for no text


def test_val_bpb_is_the_bits_of_the_text_over_its_bytes(tiny_data_dir):
    """One window covers the split but its first token: the reference counts the val documents' UTF-8 bytes
    minus that token's, and the CE in bits (float64) of every target but end-of-text."""
    torch.manual_seed(0)
    val = data.open_val_split(tiny_data_dir, 50304)
    n = 200  # the first 201 tokens: one window of 200 targets
    tokens = np.asarray(val.tokens[:n + 1])
    model = build_model("tiny", 50304, block_size=n, n_layer=1, d_model=32, n_head=2).double()
    objective = train.Objective(model, train.LossConfig(loss="ce"))
    got = train.evaluate(objective, data.ValSplit(tokens, val.byte_counts[:n + 1], val.special),
                         train.Validation(batch_size=1, block_size=n))["val_bpb"]
    enc = tokenizer.load_tokenizer("gpt2")
    text = enc.decode(tokens.tolist()).replace("<|endoftext|>", "")
    n_bytes = len(text.encode()) - len(enc.decode_single_token_bytes(int(tokens[0])))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(tokens[None, :-1], dtype=torch.long))[0].double(), dim=-1)
    targets = tokens[1:].tolist()
    bits = -sum(logp[t, y].item() for t, y in enumerate(targets) if y != 50256) / math.log(2)
    assert got == pytest.approx(bits / n_bytes, rel=1e-9)
