"""Train a byte-level BPE tokenizer of exactly N tokens, deterministically (`--tokenizer=bpe:N`).

GPT-2's recipe at another size: the ByteLevel pre-tokenizer (GPT-2's regex, no prefix space), all 256
bytes in the initial alphabet (so any UTF-8 text round-trips and there is no unknown token), merges
learned by `tokenizers`' BpeTrainer, and "<|endoftext|>" as the last id, N - 1, as GPT-2's 50256.
The result is a `tokenizers.Tokenizer`; hf.py's HFTokenizer puts tiktoken's interface on it.

Determinism (measured with tokenizers 0.23): the trainer numbers the byte alphabet in sorted order and
breaks count ties by the smaller pair of ids, so the same texts and N give the same merges, and
`to_str()` writes the vocabulary by id and the merges by rank: byte-identical JSON across processes,
PYTHONHASHSEED values and thread counts (RAYON_NUM_THREADS 1 or 2), on Shakespeare and on a tie-heavy
corpus. The one order-dependent path of the trainer (the continuing-subword prefix of WordPiece-style
models, tokenizers issue #1794) is not used here. tests/test_bpe.py checks it in two processes.
Another version of `tokenizers` may learn other merges: record the sha256 that save_tokenizer_json returns.

The trainer holds every distinct word in memory and counts pairs in 32 bits: give it a sample of a
large corpus (sample_documents), not billions of words."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import contextlib
import hashlib
import itertools
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli import config_path, parse_flags
from common import UserError, first_line, run_main
from doors import MAXIMA
from io_checks import declare_io, local_source
from safe_files import atomic_file

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # the 256 bytes and EOT: a tokenizer with no merges
_BPE_NAME = re.compile(r"bpe:([0-9]{1,8})")  # ASCII digits (\d takes "２５７"), few enough to read as a size


def parse_bpe_name(name: str) -> int | None:
    """The N of a "bpe:N" tokenizer name; None for any other name (gpt2, hf:..., a tokenizer.json). N is a size
    a real vocabulary could have (doors.MAXIMA), checked before any work: the trainer aborts on absurd ones."""
    if not name.startswith("bpe:"):
        return None
    match = _BPE_NAME.fullmatch(name)
    if not match or not MIN_VOCAB <= int(match[1]) <= MAXIMA["vocab_size"]:
        raise UserError(f"--tokenizer={name}: N must be a whole number of tokens from {MIN_VOCAB} to "
                        f"{MAXIMA['vocab_size']:,} (in ASCII digits), e.g. bpe:8192")
    return int(match[1])


def sample_documents(texts: Iterable[str], max_docs: int, progress: bool = False) -> list[str]:
    """The first max_docs documents: the same sample every time for the same source order, and it
    stops reading there, so a streamed corpus of any size costs only what is kept (a hash-based
    sample would be spread over the corpus but must read all of it)."""
    if max_docs < 1:
        raise UserError(f"max_docs={max_docs}: the tokenizer needs at least 1 document; "
                        "pass a positive number")
    docs = itertools.islice(texts, max_docs)
    if progress:
        from tqdm import tqdm
        docs = tqdm(docs, total=max_docs, desc="documents", unit="doc", file=sys.stderr)
    return list(docs)


def _byte_level(model: Any) -> Any:
    """A Tokenizer around `model` with GPT-2's byte-level pre-tokenizer, decoder and post-processor
    (hf.gpt2_tokenizer's settings, so that exports treat both alike)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to stderr for a block: the trainer's progress bars end each stage with
    a newline on stdout, which must stay free for a script's own output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def train_bpe(texts: Iterable[str], vocab_size: int, progress: bool = False) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of exactly vocab_size tokens learned from texts: ids 0-255 are the bytes
    (numbered as in GPT-2), then the merges in the order learned, then "<|endoftext|>" at vocab_size - 1. UserError when
    the corpus has too few distinct pairs for vocab_size - 257 merges, naming the largest size it supports."""
    from tokenizers import AddedToken, models, pre_tokenizers, trainers
    if vocab_size < MIN_VOCAB:
        raise UserError(f"--tokenizer=bpe:{vocab_size}: a byte-level BPE has at least {MIN_VOCAB} tokens "
                        f"(256 bytes and {EOT}); pass --tokenizer=bpe:{MIN_VOCAB} or more, e.g. bpe:8192")
    tok = _byte_level(models.BPE())
    # EOT is added after training, so it takes the id after the learned vocabulary, as in GPT-2
    # (as a trainer special token it would be id 0).
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=0, show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    docs = iter(texts)
    if progress:
        from tqdm import tqdm
        docs = tqdm(docs, desc="reading documents", unit="doc", file=sys.stderr)
    with _stdout_to_stderr() if progress else contextlib.nullcontext():
        tok.train_from_iterator(docs, trainer)
    reachable = tok.get_vocab_size() + 1
    if reachable < vocab_size:
        raise UserError(f"the corpus supports at most {reachable} tokens; pass --tokenizer=bpe:{reachable} "
                        "or less, or a larger corpus")
    tok.add_special_tokens([AddedToken(EOT, special=True)])
    # A new id, never a learned one: the pre-tokenizer splits "<|endoftext|>" into "<|", "endoftext",
    # "|>", and merges never cross those boundaries.
    assert tok.token_to_id(EOT) == vocab_size - 1 == tok.get_vocab_size(with_added_tokens=True) - 1
    return tok


def save_tokenizer_json(tokenizer: Any, path: str | Path) -> str:
    """Write tokenizer.json atomically (readers see the old file or the whole new one); returns the
    sha256 of the bytes written, to record beside the data tokenised with it. Pretty-printed, as
    `Tokenizer.save` writes it, so both give the same bytes."""
    data = tokenizer.to_str(pretty=True).encode("utf-8")
    with atomic_file(path) as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def sha256_of(path: str | Path) -> str:
    """The sha256 hex of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError as e:
        raise UserError(f"cannot read {path}: {first_line(e)}; train the tokenizer again") from None
    return digest.hexdigest()


def train_for_dataset(cfg: Any, items: Iterable[tuple[str, str, bool]], path: Path) -> str:
    """prepare.py --tokenizer=bpe:N: learn the tokenizer from the source being prepared, from its training
    split alone (its first --tokenizer_docs documents), save it as `path` and return that path."""
    texts = (text for split, text, _ in items if split == "train")
    tokenizer = train_bpe(sample_documents(texts, cfg.tokenizer_docs),
                          parse_bpe_name(cfg.tokenizer), progress=True)
    save_tokenizer_json(tokenizer, path)
    return str(path)


@dataclass
class MixConfig:
    sources: str = field(default="shakespeare", metadata={
        "help": "comma-separated sources, as prepare.py's --dataset takes them"})
    vocab_size: int = field(default=32768, metadata={"range": (MIN_VOCAB, MAXIMA["vocab_size"]),
                                                     "help": "tokens of the BPE, the 256 bytes and EOT included"})
    mix_alpha: float = field(default=0.3, metadata={  # XLM-R's 0.3
        "range": (0, 1, "(]"), "help": "each source's share of the text ~ its bytes^alpha"})
    docs_per_source: int = field(default=20_000, metadata={
        "range": (1, 1 << 40), "help": "read at most this many training documents of each source"})
    text_field: str = field(default="text", metadata={"help": "the column holding the text (.jsonl, .parquet, hub)"})
    out: str = field(default="tokenizer.json", metadata={"help": "the tokenizer.json to write"})


def mixed_documents(sources: list[list[str]], alpha: float) -> list[str]:
    """Each source's first documents, its bytes in the sample ~ (its bytes)^alpha: train.py --mix_alpha's
    sampling, for a tokenizer that serves every language in the mix. As much text as the sources allow:
    the source that limits the shares is taken whole."""
    sizes = [sum(len(t.encode()) for t in docs) for docs in sources]
    weights = [s ** alpha for s in sizes]
    scale = min(s / w for s, w in zip(sizes, weights) if w)
    picked = []
    for docs, w in zip(sources, weights):
        budget, taken = round(w * scale), 0  # bytes
        for text in docs:
            if taken >= budget:
                break
            picked.append(text)
            taken += len(text.encode())
    return picked


def main(argv: list[str]) -> None:
    """python bpe.py --sources=A,B,C --vocab_size=N --out=DIR/tokenizer.json: one byte-level BPE for a mix of
    sources, then `python prepare.py --dataset=A --tokenizer=DIR/tokenizer.json` for each of them."""
    from sources import PrepareConfig, documents
    cfg = parse_flags(MixConfig, argv)
    declare_io(reads={"--sources": [local_source(s) for s in cfg.sources.split(",")],
                      "--config": config_path(argv)}, writes={"--out": cfg.out}, kinds={"--out": "tokenizer"})
    per_source = []
    for source in cfg.sources.split(","):
        items = documents(PrepareConfig(dataset=source, text_field=cfg.text_field))[1]
        per_source.append(sample_documents((t for s, t, _ in items if s == "train"), cfg.docs_per_source))
    tokenizer = train_bpe(mixed_documents(per_source, cfg.mix_alpha), cfg.vocab_size, progress=True)
    print(f"{cfg.out}: {cfg.vocab_size} tokens, sha256 {save_tokenizer_json(tokenizer, cfg.out)}")


if __name__ == "__main__":
    run_main(main)
