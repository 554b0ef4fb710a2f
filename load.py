"""A checkpoint from any source a script accepts: a file of this project's (checkpoint.py's door), or `hf:ORG/NAME` /
`hf:FOLDER`, a Hugging Face GPT-NeoX model read as one (hf.py, an extra: imported only for such a source, so that
deleting it leaves every script working on this project's checkpoints)."""
from __future__ import annotations

from pathlib import Path

from checkpoint import Checkpoint, load_checkpoint, load_document
from common import need_extra

HF = "hf:"  # a source hf.py reads: a hub id or a folder


def load_source(path: str | Path, train_class: type | None = None) -> Checkpoint:
    """The whole checkpoint (checkpoint.load_checkpoint), or an hf: import (hf.hf_checkpoint: no state)."""
    if not str(path).startswith(HF):
        return load_checkpoint(path, train_class)
    need_extra("hf", "an hf: source")
    from hf import hf_checkpoint
    return hf_checkpoint(str(path))


def source_document(path: str | Path, train_class: type | None = None) -> Checkpoint:
    """What a plan reads of a source (checkpoint.load_document: its settings and counts, no tensor); an hf: import
    whole (it has no document)."""
    if str(path).startswith(HF):
        return load_source(path, train_class)
    return load_document(path, train_class)
