"""Tokenizers by name, to encode and decode: GPT-2's BPE through tiktoken (offline), or a tokenizer.json or
hf:ORG/NAME through hf.py (imported only for those); and texts encoded with the UTF-8 bytes each token stands for
(prepare.py writes them beside the validation tokens, for bits per byte). Learning a tokenizer (bpe:N) is bpe.py's,
when prepare.py prepares a dataset with it."""
from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

import common
import doors
from common import UserError


def load_tokenizer(name: str = "gpt2") -> Any:
    """GPT-2's BPE through tiktoken, offline; a tokenizer.json or "hf:ID" (hf:EleutherAI/pythia-70m) through hf.py."""
    if name.startswith("hf:") or name.endswith(".json"):
        common.need_extra("hf", f"--tokenizer={name}")
        from hf import load_hf_tokenizer
        return load_hf_tokenizer(name)
    if name.startswith("bpe:"):
        raise UserError(f"--tokenizer={name} is trained with a dataset: python prepare.py --tokenizer={name} ...; "
                        "a run then finds it in the dataset's folder")
    return _tiktoken(name)


@functools.cache
def _tiktoken(name: str) -> Any:
    if name != "gpt2":  # tiktoken's other encodings would be downloaded: an hf: tokenizer is the online way
        raise UserError(f"unknown tokenizer {name!r}; choose one of: gpt2, bpe:N, a tokenizer.json file, hf:ORG/NAME")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    files = common.gpt2_vocab_files()  # tiktoken checks the files' published sha256
    # tiktoken copies each file it reads into $TMPDIR/data-gym-cache, unless told where (a user's choice) or not at all
    nowhere = {} if {"TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"} & set(os.environ) else {"TIKTOKEN_CACHE_DIR": ""}
    with common.environment(nowhere):
        ranks = data_gym_to_mergeable_bpe_ranks(
            str(files["merges"]), str(files["vocab"]),
            vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
            encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def dataset_tokenizer(source: str | Path | Any) -> Any:
    """A dataset folder's or a checkpoint's (a checkpoint.Checkpoint) tokenizer: the tokenizer.json it carries, else
    by name."""
    if isinstance(source, (str, Path)):
        found = common.through_door(doors.dataset, source)
        carried, meta = found.tokenizer_json, found.meta
    else:
        carried, meta = source.tokenizer_json, source.data_meta
    if carried:
        common.need_extra("hf", "a tokenizer.json")
        from hf import tokenizer_from_json
        return tokenizer_from_json(carried, meta["tokenizer"])
    return load_tokenizer(meta.get("tokenizer", "gpt2"))


def encode_batches(items: Iterable[tuple[str, str, bool]], tokenizer: str,
                   batch: int = 128) -> Iterator[tuple[str, np.ndarray, np.ndarray, bool]]:
    """Each item's (split, token ids, the UTF-8 bytes each token stands for, ends a document), in order.
    Ordinary encoding: "<|endoftext|>" written in a text stays text."""
    enc = load_tokenizer(tokenizer)
    it = iter(items)
    while chunk := list(itertools.islice(it, batch)):
        encoded = encode_with_bytes(enc, [text for _, text, _ in chunk])
        for (split, _, end), (ids, counts) in zip(chunk, encoded):
            yield split, ids, counts, end


def encode_with_bytes(enc: Any, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each text's token ids and the UTF-8 bytes each stands for, summing to the text's: GPT-2's byte-level tokens
    spell theirs; other tokenizers (hf.HFTokenizer) measure them in context, from each token's offsets."""
    if not isinstance(enc, tiktoken.Encoding):
        return enc.encode_with_bytes(texts)
    table = tiktoken_byte_table(enc)
    ids = [np.array(i, dtype=np.uint32) for i in enc.encode_ordinary_batch(texts, num_threads=1)]
    return [(i, table[i]) for i in ids]


@functools.cache
def tiktoken_byte_table(enc: tiktoken.Encoding) -> np.ndarray:
    """The bytes of every id of a tiktoken encoding (special ones count 0: they stand for no text)."""
    table = np.zeros(enc.n_vocab, dtype=np.uint32)
    for token_bytes in enc.token_byte_values():
        table[enc.encode_single_token(token_bytes)] = len(token_bytes)
    return table
