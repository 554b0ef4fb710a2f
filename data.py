"""Prepared tokens -> training batches: a prepared dataset's folder and meta.json, its memory-mapped shards,
validation splits with the bytes each token stands for, and the check that a checkpoint goes on on its own data.
Preparing one (sources, tokenizers, writing the shards) is prepare.py's command:

    python prepare.py --dataset=roneneldan/TinyStories      # or python data.py ..., which runs prepare.py

A prepared dataset is a folder of train.bin and val.bin (token ids), val.bytes (the UTF-8 bytes each val token
stands for) and meta.json, which vouches for them (read through doors.dataset). Validation holds out whole
documents, the source's own val split or those whose text hashes below --val_fraction; end-of-text follows each."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import hashlib
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import doors
import io_checks
from common import UserError
from doors import DATA_FORMAT, same_tokenizer, special_ids  # noqa: F401 (data.X)


def split_by_hash(docs: Iterable[str], fraction: float) -> Iterator[tuple[str, str, bool]]:
    """Which split each document of a source is in: the whole document goes to val when its text's sha256, as a
    fraction of 2^64, is below `fraction` (prepare.py and corpora.py split sources by it)."""
    for text in docs:
        held_out = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < fraction * 2**64
        yield "val" if held_out else "train", text, True


# Finding and checking prepared datasets


def dataset_dir(dataset: str, data_root: str = "data", subset: str | None = None, tokenizer: str = "gpt2",
                name: str | None = None) -> Path:
    """data_root/NAME: a prepared folder as it is; else the source's last path part, its subset and any tokenizer
    but GPT-2's: roneneldan/TinyStories -> data/tinystories, with bpe:32768 data/tinystories-bpe32768."""
    path = Path(dataset)
    io_checks.check_path_names({"--data_root": [data_root]})  # its own refusal (~/d), not that of a folder under it
    if name is not None and (name in ("", ".", "..") or "/" in name or "\0" in name):
        raise UserError(f"--name={doors.clip(name)} must be one folder name under --data_root (no /, not . or ..)")
    if name or (dataset != "shakespeare" and os.path.exists(path / "meta.json")):  # never raises on a long name
        return Path(data_root) / name if name else path
    stem = path.stem if path.suffix in (".txt", ".jsonl", ".json", ".parquet") else path.name or path.resolve().name
    kind = tokenizer.replace(":", "") if tokenizer != "gpt2" else None  # bpe:N -> bpeN; GPT-2's folders keep theirs
    if tokenizer.startswith("hf:"):  # hf:EleutherAI/pythia-70m -> pythia
        kind = Path(tokenizer.removeprefix("hf:")).name.split("-")[0] or "tokenizer"
    if tokenizer.endswith(".json"):  # a tokenizer.json file: its folder's name
        kind = Path(tokenizer).absolute().parent.name or "tokenizer"
    folder = re.sub(r"[^a-z0-9._-]+", "-", "-".join(filter(None, [stem, subset, kind])).lower()).strip("-.")
    return Path(data_root) / (folder or "dataset")


def check_same_data(meta: dict, ckpt: Any, source: str | Path, dataset: str) -> None:
    """A checkpoint goes on (resumed, or a run started from it) on a dataset of its own's name only as that dataset
    was: prepared again since (shards other than the checksums its data_meta recorded), it is refused; the same
    data under another name is for the user to choose."""
    recorded = ckpt.train_config.get("dataset")  # ckpt: a checkpoint.Checkpoint
    theirs = ckpt.data_meta.get("checksums")
    name = dataset_dir(dataset.split(",")[0]).name  # a mix records its first source's meta
    if recorded and theirs and dataset_dir(recorded.split(",")[0]).name == name and theirs != meta.get("checksums"):
        raise UserError(f"{source} was trained on {name} as it was then, and {name} was prepared again since (its "
                        "shards differ from the checksums the checkpoint recorded): a run goes on only on its own "
                        "data; prepare the new data under another name (prepare.py --name=NAME), or start over with "
                        "--overwrite")


def recorded_dataset(recorded: str, data_root: str, ckpt: str | Path) -> str:
    """The dataset a checkpoint records, found by its folder's name under this command's --data_root: a path inside
    a checkpoint is never opened (/elsewhere/books is data_root/books). The built-in corpus is prepared there."""
    name = dataset_dir(Path(recorded).name).name
    if re.fullmatch(r"shakespeare(-bpe\d+)?", name):
        return name
    folder = Path(data_root) / name
    if not (folder / "meta.json").exists():
        raise UserError(f"{ckpt} was trained on {doors.brief(recorded)}, looked for as {folder} (a path inside a "
                        "checkpoint is never opened), which is not a prepared dataset; pass --data_root=FOLDER that "
                        f"holds {name}, or --dataset=NAME")
    return str(folder)


def load_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared dataset, through its door (doors.dataset), with its tokenizer.json checked."""
    return common.through_door(doors.dataset, data_dir).meta


def open_split(data_dir: str | Path, split: str, vocab_size: int | None = None) -> np.memmap:
    """A read-only memmap of train.bin or val.bin, checked first at its door (count, sha256, ids below vocab_size):
    a damaged or mismatched dataset fails at start-up, not hours into a run."""
    return common.through_door(doors.dataset, data_dir, (f"{split}.bin",), vocab_size).arrays[f"{split}.bin"]


@dataclass
class ValSplit:
    """What validation scores of a dataset: its tokens; for bits per byte, the bytes each stands for (byte_counts[i]:
    token i's) and the special ids (no bytes)."""
    tokens: np.ndarray
    byte_counts: np.ndarray | None = None
    special: list[int] = field(default_factory=list)


def open_val_split(data_dir: str | Path, vocab_size: int, bytes: bool = True) -> ValSplit:
    found = common.through_door(doors.dataset, data_dir, ("val.bin", "val.bytes")[:1 + bytes], vocab_size)
    return ValSplit(found.arrays["val.bin"], found.arrays.get("val.bytes"), special_ids(found.meta))


# Batches: windows of block_size + 1 tokens, as (inputs, next tokens)


def _windows(values: np.ndarray, starts: np.ndarray, length: int, device) -> torch.Tensor:
    windows = torch.from_numpy(values[starts[:, None] + np.arange(length)].astype(np.int64))
    if torch.device(device).type == "cuda":  # pinned memory: the copy overlaps with compute
        windows = windows.pin_memory().to(device, non_blocking=True)
    return windows


def _check_block_size(tokens: np.ndarray, block_size: int, batch_size: int = 1) -> None:
    needs = max(block_size + 1, batch_size * block_size)  # a window; a training batch (or it would never fit)
    if block_size < 1 or needs > len(tokens):
        raise UserError(f"block_size={block_size} x batch_size={batch_size} needs {needs} tokens; the split holds "
                        f"{len(tokens)}: lower --block_size or --batch_size")


NEGATIVES_STREAM = 1  # the random streams of a micro-batch besides its windows (BatchSampler) and masks (masking.py)
DROPOUT_STREAM = 2


def stream_seed(seed: int, index: int, stream: int) -> int:
    """The seed of micro-batch `index`'s draws in a random stream (train.py's sampled negatives and dropout): (seed,
    index, stream) hashed (numpy's SeedSequence), so that no two runs' micro-batches share draws (seed * 1_000_003 +
    index would: seed 1337 at index 1,000,003 is seed 1338 at index 0)."""
    return int(np.random.SeedSequence([seed, index, stream]).generate_state(1, np.uint64)[0])


class BatchSampler:
    """Random training windows; batch `index` is a pure function of (seed, index): resuming needs nothing else."""

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int, device="cpu"):
        _check_block_size(tokens, block_size, batch_size)
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.seed = seed
        self.device = device

    def window_starts(self, index: int) -> np.ndarray:
        """Where batch `index`'s windows of block_size + 1 tokens start (analyze.py replays them to count reads)."""
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = _windows(self.tokens, self.window_starts(index), self.block_size + 1, self.device)
        return windows[:, :-1], windows[:, 1:]


def sequential_batches(tokens: np.ndarray, batch_size: int, block_size: int, device="cpu",
                       max_batches: int | None = None, rank: int = 0, world: int = 1,
                       byte_counts: np.ndarray | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, Any]]:
    """(i, inputs, targets, the targets' bytes) of windows from the split's start, for evaluation; the bytes
    (a ValSplit's byte_counts) are None without byte_counts. Rank r builds the batches i = r mod world."""
    _check_block_size(tokens, block_size)
    starts = np.arange((len(tokens) - 1) // block_size) * block_size
    batches = range(0, len(starts), batch_size)
    if max_batches is not None:
        batches = batches[:max_batches]
    for i in range(rank, len(batches), world):
        window_starts = starts[batches[i]:batches[i] + batch_size]
        windows = _windows(tokens, window_starts, block_size + 1, device)
        y_bytes = None if byte_counts is None else _windows(byte_counts, window_starts + 1, block_size, device)
        yield i, windows[:, :-1], windows[:, 1:], y_bytes


if __name__ == "__main__":  # preparing is prepare.py's command: the same arguments, run as a new process
    os.execv(sys.executable, [sys.executable, str(Path(__file__).with_name("prepare.py")), *sys.argv[1:]])
