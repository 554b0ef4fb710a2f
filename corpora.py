"""Real corpora for prepare.py, through the `datasets` library: Hugging Face hub datasets (streamed, so
FineWeb-Edu never has to fit on disk) and local .txt, .jsonl or .parquet files; and tokenising in
several processes (--num_proc).

Validation: a hub dataset with a `validation` split (TinyStories) uses it, and so does a local folder whose
files are named as `datasets` names splits (train.jsonl and validation.jsonl, data/valid-000.parquet...);
--val_split=hash holds out documents by hash instead, as for any other source. One local .txt file is one
document, split once near its end."""
from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import re
import shutil
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import doors
import safe_files
from cli import refuse_idle
from common import UserError, check_hub, first_line, through_door
from data import load_meta, split_by_hash
from tokenizer import encode_batches

FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
SPLIT_WORDS = {"train": ("train", "training"), "val": ("validation", "valid", "val", "dev")}
OWN_VAL = "with the source's own validation split (nothing is held out by hash; --val_split=hash would)"


def open_corpus(cfg: Any) -> tuple[str, Iterable[tuple[str, str, bool]], int | None]:
    """(description, (split, text, ends a document) items, number of documents if known) of cfg."""
    if not cfg.dataset.strip():
        raise UserError("--dataset is empty; use shakespeare, a Hugging Face id or a local path")
    path = Path(cfg.dataset)
    if path.exists() or cfg.dataset.startswith(("/", ".")) or path.suffix in FORMATS:
        return open_local(path, cfg)
    if not HUB_ID.match(cfg.dataset):
        raise UserError(f"unknown dataset {cfg.dataset!r}: use shakespeare, a Hugging Face id such as "
                        "roneneldan/TinyStories, or a path to .txt/.jsonl/.parquet files")
    source = f"hf:{cfg.dataset}" + (f"/{cfg.subset}" if cfg.subset else "") + f" split={cfg.split}"
    hint = "check the id, --subset and --split, and the network (or pass a local path)"
    check_hub(f"dataset {cfg.dataset!r}", "check the network, or pass a local path")  # offline: in seconds
    train = Texts(load(cfg, f"dataset {cfg.dataset!r}", hint, cfg.dataset, cfg.subset, split=cfg.split,
                       streaming=True), cfg.text_field, source)
    own_val = cfg.val_split == "auto" and cfg.split == "train" and "validation" in split_names(cfg)
    if not own_val:
        return source, Items([train], split_by_hash(train, cfg.val_fraction), cfg), None
    refuse_idle(cfg, {"val_fraction": OWN_VAL})
    val = Texts(load(cfg, f"dataset {cfg.dataset!r}", hint, cfg.dataset, cfg.subset, split="validation",
                     streaming=True), cfg.text_field, source + " (validation)")
    return source + " + its validation split", Items([train, val], own_splits(train, val), cfg), None


def open_local(path: Path, cfg: Any) -> tuple[str, Iterable[tuple[str, str, bool]], int | None]:
    """A local file or folder of one format; .txt files are one document each."""
    if not path.exists():
        raise UserError(f"{path} does not exist; pass an existing .txt/.jsonl/.parquet file or folder")
    if (path / "meta.json").exists():
        raise UserError(f"{path} is already a prepared dataset; pass it to train.py as --dataset={path}")
    files = sorted(p for p in path.rglob("*") if p.suffix in FORMATS) if path.is_dir() else [path]
    builders = {FORMATS.get(p.suffix) for p in files}
    if not files or None in builders:
        raise UserError(f"{path} holds no .txt, .jsonl or .parquet files; point --dataset at a folder of them")
    if len(builders) > 1:
        raise UserError(f"{path} mixes file formats ({', '.join(sorted(builders))}); use one format per folder")
    builder = builders.pop()
    local = "for a local path (its files are the data; name them train and validation to give it splits)"
    refuse_idle(cfg, {"subset": local, "split": local,
                      **({"text_field": "for .txt files (each file is one document's text)"} if builder == "text"
                         else {})})
    for file in files:
        check_corpus_file(file)
    field = "text" if builder == "text" else cfg.text_field
    source = f"{path.resolve()} ({len(files)} {builder} file(s))"
    by_split = {s: [f for f in files if split_of(f) == s] for s in ("train", "val")}
    if cfg.val_split == "auto" and by_split["val"]:
        refuse_idle(cfg, {"val_fraction": OWN_VAL})
        if stray := [f for f in files if split_of(f) is None]:
            raise UserError(f"{stray[0]} is named neither as train nor as validation data while {path} has "
                            "both; move it out, or pass --val_split=hash")
        train, val = (Texts(read_files(cfg, by_split[s], builder, source), field, source) for s in ("train", "val"))
        return source + ", its own validation files", Items([train, val], own_splits(train, val), cfg), None
    texts = Texts(read_files(cfg, files, builder, source), field, source)
    if builder == "text" and len(files) == 1:  # one document: split once, near its end
        return source, Items([texts], (item for text in texts for item in
                                       split_one_document(text, cfg.val_fraction)), cfg), 1
    return source, Items([texts], split_by_hash(texts, cfg.val_fraction), cfg), None


MAX_DOCUMENT_BYTES = 1 << 30  # what a corpus holds in memory at once: a .txt or .json file, a .jsonl line
SCAN_BYTES = 1 << 24  # a .jsonl file's lines are measured this many bytes at a time


def check_corpus_file(path: Path) -> None:
    """A corpus file within the bound of its kind, before the datasets library reads it: a regular file, not sparse
    (holes cost nothing on disk and everything in memory); a .txt file (one document) or a .json one (one JSON
    value) of at most MAX_DOCUMENT_BYTES, read whole; a .jsonl file whose every line (a row, read whole) is."""
    fix = "split it into smaller files (a .jsonl file of one document a line streams)"
    f, info = through_door(doors.opened, path, "corpus file", "pass a .txt, .jsonl or .parquet file")
    with f:
        why = doors.holes_problem(f.fileno(), info.st_size)
        if why:
            raise UserError(f"corpus file {path} {why}; pass the real file")
        if path.suffix in (".txt", ".json") and info.st_size > MAX_DOCUMENT_BYTES:
            kind = "document" if path.suffix == ".txt" else "JSON value (one object a line: name it .jsonl)"
            raise UserError(f"corpus file {path} is {info.st_size:,} bytes, read whole as one {kind}: more than "
                            f"{MAX_DOCUMENT_BYTES:,}; {fix}")
        if path.suffix == ".jsonl" and (longest := longest_line(f)) > MAX_DOCUMENT_BYTES:
            raise UserError(f"corpus file {path} has a line of more than {longest:,} bytes, read whole as one row: "
                            f"more than {MAX_DOCUMENT_BYTES:,}; {fix}")


def longest_line(f: Any) -> int:
    """The length of the longest line of a file, read SCAN_BYTES at a time; it stops at the first line known to be
    longer than MAX_DOCUMENT_BYTES (a 3 GB file with no newline costs one pass, never memory)."""
    longest = run = 0  # run: the length of the line the last chunk ended in
    while (chunk := f.read(SCAN_BYTES)) and longest <= MAX_DOCUMENT_BYTES:
        ends = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n"))
        if not len(ends):
            run += len(chunk)
        else:
            longest = max(longest, run + int(ends[0]), int(np.diff(ends).max(initial=1)) - 1)
            run = len(chunk) - int(ends[-1]) - 1
        longest = max(longest, run)
    return longest


def split_one_document(text: str, fraction: float) -> Iterator[tuple[str, str, bool]]:
    """A source that is one document: train gets its start, val its last lines (about fraction of it)."""
    cut = text.rfind("\n", 0, round(len(text) * (1 - fraction))) + 1 or text.find("\n") + 1
    if not 0 < cut < len(text):
        raise UserError("the val split is empty: a source of one document is split at a line break near its "
                        "end, and it has no line break; add some, or pass more files")
    return iter([("train", text[:cut], False), ("val", text[cut:], True)])


def split_of(path: Path) -> str | None:
    """"train" or "val" by the words of a file's name, as `datasets` assigns splits (train-00.parquet)."""
    words = set(re.split(r"[-._ 0-9]+", path.stem.lower()))
    return next((split for split, names in SPLIT_WORDS.items() if words & set(names)), None)


def own_splits(train: Iterable[str], val: Iterable[str]) -> Iterator[tuple[str, str, bool]]:
    """Validation first: --max_tokens or --max_docs then cut the training data, never the held-out text."""
    yield from (("val", text, True) for text in val)
    yield from (("train", text, True) for text in train)


def split_names(cfg: Any) -> list[str]:
    import datasets
    try:
        with datasets_cache(cfg) as cache:
            return datasets.get_dataset_split_names(cfg.dataset, cfg.subset, cache_dir=cache)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"could not load dataset {cfg.dataset!r}: {first_line(e)}; check the id, --subset "
                        "and the network, or pass --val_split=hash") from None


def read_files(cfg: Any, files: list[Path], builder: str, source: str) -> Any:
    # Streaming reads the files lazily, with no Arrow cache copy; .txt: one file is one document.
    options = {"sample_by": "document"} if builder == "text" else {}
    return load(cfg, source, "is every file valid?", builder, data_files=[str(f) for f in files], split="train",
                streaming=True, **options)


def load(cfg: Any, what: str, hint: str, *args: Any, **kwargs: Any) -> Any:
    import datasets  # slow to import, and only real corpora need it
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures are reported here, in one line
    try:
        with datasets_cache(cfg) as cache:
            return datasets.load_dataset(*args, cache_dir=cache, **kwargs)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"could not load {what}: {first_line(e).rstrip('.')}; {hint}") from None


@contextlib.contextmanager
def datasets_cache(cfg: Any) -> Iterator[str | None]:
    """The datasets library's cache for one call, a temp folder inside --data_root, removed after it (with the
    folders made for it): it writes lock files there (in ~/.cache/huggingface/datasets by default), which a stream
    needs no more once opened. A prepare.py killed meanwhile leaves it to the next one's sweep (its pid is in its name).
    Where HF_DATASETS_CACHE or HF_HOME says where (the user's choice), the library's own (None)."""
    if os.environ.get("HF_DATASETS_CACHE") or os.environ.get("HF_HOME"):
        yield None
        return
    root = Path(cfg.data_root)
    made = [p for p in (root, *root.parents) if not os.path.lexists(p)]
    cache = safe_files.temp_path(root / "datasets-cache")
    try:
        try:
            cache.mkdir(parents=True)
        except OSError as e:
            raise UserError(f"cannot write in --data_root={cfg.data_root} ({e.strerror}); pass a folder you can "
                            "write") from None
        yield str(cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        for folder in made:  # the deepest first; only while empty
            with contextlib.suppress(OSError):
                folder.rmdir()


class Texts:
    """The text of each row. A field no row has is an error; rows without text in it (a .jsonl line that
    lacks it, a null, an empty string) are skipped and counted."""

    def __init__(self, rows: Iterable[dict], field: str, source: str):
        self.rows, self.field, self.source, self.skipped = rows, field, source, 0

    def __iter__(self) -> Iterator[str]:
        rows = iter(self.rows)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # malformed JSON, a corrupt parquet file, a dropped connection
                raise UserError(f"could not read {self.source}: {first_line(e)}") from None
            if self.field not in row:
                raise UserError(f"{self.source} has no field {self.field!r} (fields: {', '.join(row)}); "
                                "pass --text_field=NAME")
            text = row[self.field]
            if text is not None and not isinstance(text, str):
                raise UserError(f"field {self.field!r} of {self.source} holds {type(text).__name__}, not text; "
                                "pass --text_field=NAME of a text column")
            if text:
                yield text
            else:
                self.skipped += 1


class Items:
    """(split, text, ends a document) items that count the rows their sources skipped, and say so; and what
    they were read from, so that a folder of another source's dataset is never replaced by this one."""

    def __init__(self, texts: list[Texts], items: Iterable[tuple[str, str, bool]], cfg: Any):
        self.texts, self.items = texts, items
        path = Path(cfg.dataset)
        self.source_id = str(path.resolve()) if path.exists() or cfg.dataset.startswith(("/", ".")) else \
            f"hf:{cfg.dataset}" + (f"/{cfg.subset}" if cfg.subset else "") + f" split={cfg.split}"

    def check_same_source(self, out: Path) -> None:
        """Prepare again only from the same source: two local folders called `books` map to data_root/books."""
        try:
            old = load_meta(out).get("source_id")  # through its door: a FIFO or a folder is no meta.json
        except UserError:
            return  # no dataset, or a broken one that vouches for nothing
        if old is not None and old != self.source_id:
            raise UserError(f"{out} already holds a dataset prepared from {old}; preparing {self.source_id} would "
                            f"replace it: pass another --data_root, or delete {out} first")

    @property
    def skipped(self) -> int:
        return sum(t.skipped for t in self.texts)

    def __iter__(self) -> Iterator[tuple[str, str, bool]]:
        yield from self.items
        if self.skipped:
            print(f"skipped {self.skipped:,} rows of {self.texts[0].source} without text in field "
                  f"{self.texts[0].field!r} (missing, null or empty)", file=sys.stderr)


def encode_in_processes(items: Iterable[tuple[str, str, bool]], tokenizer: str, num_proc: int,
                        batch: int = 128) -> Iterator[tuple[str, np.ndarray, bool]]:
    """encode_batches in num_proc processes, in input order. A few batches in flight bound the memory
    (Pool.imap would read the whole corpus ahead); fork: workers inherit the loaded tokenizer."""
    it = iter(items)
    with multiprocessing.get_context("fork").Pool(num_proc) as pool:
        pending: deque = deque()
        while chunk := list(itertools.islice(it, batch)):
            pending.append(pool.apply_async(encode_chunk, (chunk, tokenizer)))
            if len(pending) >= 4 * num_proc:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


def encode_chunk(chunk: list[tuple[str, str, bool]], tokenizer: str) -> list[tuple[str, np.ndarray, bool]]:
    return list(encode_batches(chunk, tokenizer, len(chunk)))
