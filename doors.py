"""The doors: the one way in for each kind of input: cli.settings(cls, argv) (flags over a --config file),
dataset(folder, files), jsonl_rows(path) (line formats), run_log(path) and results_file(path) (a run's log,
compare.py's state); a file whose contents are a declared type (a checkpoint: checkpoint.py) is checked by
declared_problem, from its declaration. A door checks a file (a regular one, of a sane size), then every field's
type and range, and against the weights or the data where they constrain it, before anything is allocated or built;
bad input is refused in one line naming it and the fix. Plumbing a learner may skip. It imports no other file of
this project, so a refusal is a Refused, a ValueError: the scripts show it as their one-line UserError
(common.through_door)."""
from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import itertools
import json
import math
import os
import re
import shlex
import stat
import tomllib
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple

import numpy as np
import torch


class Refused(ValueError):
    """An input refused at its door: the message is one line naming it, the problem and the fix."""


# What a real model could have: a file that claims more is refused before anything is built (docs/failures.md). The
# highs of model.GPTConfig's fields' ranges (tests/test_hackable.py keeps them one), for the doors of other files.
MAXIMA = {"vocab_size": 1 << 22, "block_size": 1 << 20, "n_layer": 1024, "d_model": 1 << 16, "n_head": 1024,
          "mlp_hidden": 1 << 18}
MAX_STEP_TOKENS = 1 << 30  # batch_size x block_size x grad_accum: a rank's tokens in one step (Llama 3's: 2^24)
# Files read whole are read within these bounds, measured by reading (at most the bound + 1 bytes)
MAX_TEXT_BYTES = 16 << 20  # --config files, meta.json, config.json, a safetensors header, results files
MAX_TOKENIZER_BYTES = 64 << 20  # a tokenizer.json (real ones: 0.5 to 35 MB)
MAX_HASHED_BYTES = 2 << 30  # shards up to this size are checked against their sha256 at every start
BIG = 1 << 62  # any count
SHA256 = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------------------------------- small files


def opened(path: str | Path, what: str, fix: str) -> tuple[IO[bytes], os.stat_result]:
    """`path` opened for reading, and its stat, if it is a regular file: checked before a byte is read (/dev/zero
    never ends), and opened without blocking (a FIFO would wait for a writer forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        why = f"cannot be read ({e.strerror})"
        if isinstance(e, FileNotFoundError):
            why = "is a dangling symbolic link" if os.path.islink(path) else "not found"
        raise Refused(f"{what} {path} {why}; {fix}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, pipe or socket)"
        raise Refused(f"{what} {path} is {kind}; {fix}")
    return os.fdopen(fd, "rb"), info


def read_small(path: str | Path, limit: int, what: str, fix: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, measured by reading at most limit + 1 of them (a /proc
    file says it has none, a file may grow after its stat); one that says it has more is refused unread."""
    f, info = opened(path, what, fix)
    with f:
        data = f.read(limit + 1) if info.st_size <= limit else None
    if data is None or len(data) > limit:
        size = f"{info.st_size:,} bytes" if data is None else f"more than {limit:,} bytes"
        raise Refused(f"{what} {path} is {size}, more than a {what} can be ({limit:,}); {fix}")
    return data


def parse(data: bytes, where: str, fix: str, kind: str = "JSON") -> Any:
    """JSON or TOML read from a file's bytes: any way they are broken is one line."""
    try:
        text = data.decode(json.detect_encoding(data) if kind == "JSON" else "utf-8")
    except UnicodeDecodeError as e:
        raise Refused(f"{where} is not UTF-8 text (byte {e.start}); {fix}") from None
    try:
        return json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except RecursionError:
        raise Refused(f"{where} is {kind} nested too deeply; {fix}") from None
    except ValueError as e:  # bad JSON or TOML, a 5,000-digit number
        raise Refused(f"{where} is not valid {kind}: {(str(e).splitlines() or ['?'])[0]}; {fix}") from None


def json_file(path: str | Path, limit: int, what: str, fix: str) -> Any:
    """A JSON file of at most `limit` bytes, parsed (the caller checks what it holds)."""
    return parse(read_small(path, limit, what, fix), f"{what} {path}", fix)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def brief(value: Any, limit: int = 60) -> str:
    """repr(value) cut short, for a value from a file in a one-line message."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more than 4300 digits
        return f"a {type(value).__name__} too long to show"
    return text if len(text) <= limit else text[:limit] + "..."


def clip(text: str, limit: int = 80) -> str:
    """Text from a file (a name, a source) as it reads inside a one-line message: what a terminal would not print
    as itself escaped, cut short."""
    shown = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(text))
    return shown if len(shown) <= limit else shown[:limit] + "..."


@functools.lru_cache(maxsize=4)  # a run's doors read its dataset's tokenizer.json several times
def tokenizer_problem(text: str) -> tuple[str | None, int]:
    """Why a tokenizer.json's text is not a Hugging Face tokenizer (what its library says, in one line), or None;
    and the number of its ids (the largest + 1)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return "cannot be read: the tokenizers package is missing (pip install -r requirements.txt)", 0
    try:
        ids = Tokenizer.from_str(text).get_vocab(with_added_tokens=True).values()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # the Rust library's errors, its panics (BaseExceptions) included
        return f"is not a Hugging Face tokenizer.json: {brief(first_line(e), 120)}", 0
    return (None, max(ids) + 1) if ids else ("is not a Hugging Face tokenizer.json: it has no tokens", 0)


def tokenizer_file(path: str | Path, what: str, fix: str) -> str:
    """A tokenizer.json file's text, once its library reads it as a tokenizer (at most MAX_TOKENIZER_BYTES)."""
    return tokenizer_text(read_small(path, MAX_TOKENIZER_BYTES, what, fix), f"{what} {path}", fix)


def tokenizer_text(data: bytes, where: str, fix: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Refused(f"{where} is not a Hugging Face tokenizer.json: not UTF-8 text (byte {e.start}); {fix}") from None
    if why := tokenizer_problem(text)[0]:
        raise Refused(f"{where} {why}; {fix}")
    return text


# ---------------------------------------------------------------------------------------------- settings

# A setting's rule and meaning are declared once, on its dataclass field: its type hint, and in the field's metadata
#   "help": what it means, one line (--help shows it beside the type, default and range; docs/training.md's table)
#   "range": (low, high) or (low, high, ends): a number's bounds (each of a list's), `ends` "[]" (the default),
#       "(]", "[)" or "()"
#   "resume": what --resume does with it (plan.resumed_settings): "kept" (the default: the run's own unless given,
#       a given one applies from there on), "same" (a given one must be the run's own: another value is another
#       experiment), "here" (this command's: where files are, the device, --resume itself)
# The flag, a --config file, --help and a checkpoint's train_config / model_config all follow it (field_rules). A
# subclass that redeclares a field to change its default keeps the base field's rule and meaning (field_meta).


def field_meta(cls: type, name: str) -> dict[str, Any]:
    """The metadata of dataclass `cls`'s field `name`, merged over its bases' declarations of the same field."""
    meta: dict[str, Any] = {}
    for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        declared = base.__dict__.get("__dataclass_fields__", {}).get(name)
        if declared is not None and name in base.__dict__.get("__annotations__", {}):
            meta.update(declared.metadata)
    return meta


def field_rules(cls: type) -> dict[str, tuple]:
    """fields_problem's rule of each field of dataclass `cls`: its type hint and its declared range."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], *field_meta(cls, f.name).get("range", ())) for f in dataclasses.fields(cls)}


def shown_number(x: float) -> str:
    """A bound exactly as declared: an int in all its digits, a float in its short form where that is exact (1e+12,
    0.001), else as Python writes it back."""
    if isinstance(x, int):
        return str(x)
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


# ---------------------------------------------------------------------------------------------- fields


def problem(value: Any, kinds: Any, low: float = -1e300, high: float = 1e300, ends: str = "[]") -> str | None:
    """Why `value` breaks its rule, or None. kinds: a type or a tuple of them (None: may be null; float takes whole
    numbers too; int never a bool), a list of the values allowed, or a type hint (int | None, a Literal, list[int],
    bool | Literal["auto"]). Numbers: within low..high, `ends` saying whether each end is included (NaN never is)."""
    if typing.get_origin(kinds) is list:
        if not isinstance(value, list):
            return f"is {brief(value)}, not a list"
        return next(filter(None, (problem(v, typing.get_args(kinds)[0], low, high, ends) for v in value)), None)
    kinds = plain_kinds(kinds)
    if isinstance(kinds, list):
        fits = any(value == k and type(value) is type(k) for k in kinds)
        return None if fits else f"is {brief(value)}, not one of: {', '.join(map(str, kinds))}"
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if value is None and None in kinds:
        return None
    types = tuple(k for k in kinds if k is not None) + ((int,) if float in kinds else ())
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in kinds):
        return f"is {brief(value)}, not {' or '.join(getattr(k, '__name__', 'null') for k in kinds)}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"is {value}, not a finite number"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
            low <= value <= high and (value != low or ends[0] == "[") and (value != high or ends[1] == "]")):
        return f"is {brief(value)}, outside {ends[0]}{shown_number(low)}, {shown_number(high)}{ends[1]}"
    return None


def plain_kinds(hint: Any) -> Any:
    """A field's type hint in problem's terms: a Literal (or a union with one) the list of its values, any other
    union the tuple of its types (None for null)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return list(typing.get_args(hint))
    if origin not in (typing.Union, types.UnionType):
        return hint
    members = [plain_kinds(a) for a in typing.get_args(hint)]
    if any(isinstance(m, list) for m in members):  # Literal[...] | None, bool | Literal["auto"]
        return [v for m in members for v in (m if isinstance(m, list) else [True, False] if m is bool else [None])]
    return tuple(None if m is type(None) else m for m in members)


def fields_problem(values: Any, rules: dict[str, tuple], name: str = "", needs: tuple = (),
                   others: bool = False) -> str | None:
    """The first way a table (`name`) breaks its rules: not a table, a needed field missing, a field of no rule
    (unless `others`: then a plain value, a number, string, true/false, null or a list of them), a bad value."""
    table = f"{name} " if name else ""
    if not isinstance(values, dict):
        return f"{table}is {brief(values)}, not a table"
    if missing := [k for k in needs if k not in values]:
        return f"{table}lacks {', '.join(missing)}"
    for key, value in values.items():
        if key in rules:
            why = problem(value, *rules[key])
        elif others:
            why = next(filter(None, (problem(v, (bool, float, str, None)) for v in
                                     (value if isinstance(value, list) else [value]))), None)
        else:
            why = "is not a field of this code's"
        if why:
            return f"{name}.{str(key)[:60]} {why}" if name else f"{str(key)[:60]} {why}"
    return None


# ---------------------------------------------------------------------------------------------- declared types

# What a file holds is declared once, as a dataclass (a checkpoint's checkpoint.Checkpoint, a dataset's DatasetMeta,
# a results file's): each field's type hint (int, float, str, bool, a Literal, X | None, list[X], dict[str, X], a
# nested dataclass, torch.Tensor) and its metadata "range", as a setting's. declared_problem checks a table read from
# a file against it, every float finite; declared builds the dataclass. A field with a default may be missing (an
# older file); a key the class does not declare is refused, unless its class declares OTHERS, their type.


def declared_problem(values: Any, cls: type, name: str = "", partial: bool = False) -> str | None:
    """The first way a table (`name`) breaks dataclass `cls`'s declaration, or None; `partial`: the fields it has."""
    table = f"{name} " if name else ""
    if not isinstance(values, dict):
        return f"{table}is {brief(values)}, not a table"
    fields = {f.name: f for f in dataclasses.fields(cls)}
    needed = [] if partial else [k for k, f in fields.items() if f.default is f.default_factory is dataclasses.MISSING]
    if missing := [k for k in needed if k not in values]:
        return f"{table}lacks {', '.join(missing)}"
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        where = f"{name}.{str(key)[:60]}" if name else str(key)[:60]
        if key in fields:
            meta = field_meta(cls, key)
            why = typed_problem(hints[key], value, where, *meta.get("range", ()), dtypes=meta.get("dtypes"))
        elif hasattr(cls, "OTHERS"):  # the type of the keys it does not declare (Any: carried along, never read)
            why = typed_problem(cls.OTHERS, value, where)
        else:
            why = f"{where} is not a field of this code's"
        if why:
            return why
    return None


def typed_problem(hint: Any, value: Any, where: str, *bounds: Any, dtypes: tuple | None = None) -> str | None:
    """Why `value` is not of type `hint` (within `bounds`, for numbers; of one of `dtypes`, for tensors: a field's
    metadata "dtypes", a name for them first), as a line naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if dataclasses.is_dataclass(hint):
        return declared_problem(value, hint, where)
    if origin in (typing.Union, types.UnionType) and value is None and type(None) in args:
        return None
    if origin in (typing.Union, types.UnionType) and sum(a is not type(None) for a in args) == 1:
        return typed_problem(next(a for a in args if a is not type(None)), value, where, *bounds, dtypes=dtypes)
    if origin is dict:
        if not isinstance(value, dict):
            return f"{where} is {brief(value)}, not a table"
        return next(filter(None, (f"{where} has a key {brief(k)} that is not a name" if not isinstance(k, str) else
                                  typed_problem(args[1], v, f"{where}.{k[:60]}", *bounds, dtypes=dtypes)
                                  for k, v in value.items())),
                    None)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return f"{where} is {brief(value)}, not a list"
        return next(filter(None, (typed_problem(args[0], v, where, *bounds, dtypes=dtypes) for v in value)), None)
    if dtypes and isinstance(value, torch.Tensor) and value.dtype not in dtypes[1:]:
        return f"{where} is {value.dtype}, not {dtypes[0]}"
    why = problem(value, hint, *bounds)
    return why and f"{where} {why}"


def declared(cls: type, values: dict) -> Any:
    """Dataclass `cls` from a table declared_problem let in: nested dataclasses built, lists of tuples as tuples; a
    missing field its default; an OTHERS class's other keys left out."""
    hints = typing.get_type_hints(cls)
    built = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            built[f.name] = typed(hints[f.name], values[f.name])
    return cls(**built)


def typed(hint: Any, value: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if value is None:
        return None
    if dataclasses.is_dataclass(hint):
        return declared(hint, value)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return typed(args[0], value)
    return tuple(value) if typing.get_origin(hint) is tuple else value


def plain(value: Any) -> Any:
    """A declared object as the table a file holds (tensors as they are, not copied)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------------------------------------- datasets

# meta.json's "format": 1 cut the end off every document for val, 2 held out whole documents, 3 added val.bytes
DATA_FORMAT = 3
COUNT_RANGE = {"range": (0, BIG)}  # a field that counts


@dataclasses.dataclass
class DatasetMeta:
    """A prepared dataset's meta.json (data.py writes it; a checkpoint carries it as data_meta): read as the table it
    is (data.py reads it by key), checked by this declaration. Other keys are carried along."""
    OTHERS: typing.ClassVar[Any] = bool | float | str | list | None
    tokenizer: str
    vocab_size: int = dataclasses.field(metadata={"range": (1, MAXIMA["vocab_size"])})
    dtype: str
    eot_token: int = dataclasses.field(metadata=COUNT_RANGE)
    train_tokens: int = dataclasses.field(metadata={"range": (1, BIG)})
    val_tokens: int = dataclasses.field(metadata={"range": (1, BIG)})
    val_bytes: int = dataclasses.field(metadata=COUNT_RANGE)
    checksums: dict[str, str]
    format: int = dataclasses.field(default=DATA_FORMAT, metadata=COUNT_RANGE)  # its door takes DATA_FORMAT alone
    tokenizer_sha256: str | None = None
    documents: int = dataclasses.field(default=0, metadata=COUNT_RANGE)
    mask_token: int | None = dataclasses.field(default=None, metadata=COUNT_RANGE)
    special_tokens: list[int] | None = None
    source: str = ""
    source_id: str = ""
    skipped_rows: int = dataclasses.field(default=0, metadata=COUNT_RANGE)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)  # uint16 halves disk and RAM


def shard_dtypes(vocab_size: int) -> dict[str, np.dtype]:
    """The files of a prepared dataset, each an array of this dtype: the token ids of each split, and the
    UTF-8 bytes each validation token stands for (a count can exceed 65,535 where a tokenizer drops text)."""
    return {"train.bin": token_dtype(vocab_size), "val.bin": token_dtype(vocab_size), "val.bytes": np.dtype(np.uint32)}


@dataclasses.dataclass
class Shard:
    """Appends values to an open shard file, counting, summing and hashing them as it goes (prepare.prepare)."""
    file: IO[bytes]
    dtype: np.dtype
    tokens: int = 0
    total: int = 0
    sha256: Any = dataclasses.field(default_factory=hashlib.sha256)

    def write(self, values: np.ndarray) -> None:
        data = values.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(values)
        self.total += int(values.sum(dtype=np.int64))


class Dataset(NamedTuple):
    """A dataset its door let in: meta.json, tokenizer.json's text (None: tiktoken's), the files as memmaps."""
    meta: dict
    tokenizer_json: str | None
    arrays: dict[str, np.memmap]


def dataset(folder: str | Path, files: tuple[str, ...] = (), vocab_size: int | None = None) -> Dataset:
    """A prepared dataset folder through its door: meta.json (its format, every field's type and range, the dtype
    its vocabulary implies), tokenizer.json against the sha256 meta.json records, then each of `files` (train.bin,
    val.bin, val.bytes): meta.json's count of values, its sha256 (up to MAX_HASHED_BYTES: more would cost seconds
    at every start), no id beyond the model's vocab_size if given; val.bytes sums to val_bytes."""
    folder = Path(folder)
    meta = dataset_meta(folder)
    source = clip(meta.get("settings", {}).get("dataset", "..."), 400)  # a file's text: quoted, never run if pasted
    redo = f"prepare the dataset again: python prepare.py {shlex.quote(f'--dataset={source}')}"
    path = folder / "tokenizer.json"
    sha256 = meta.get("tokenizer_sha256")  # None: tiktoken's, and no tokenizer.json
    data = read_small(path, MAX_TOKENIZER_BYTES, "tokenizer file", redo) if sha256 or os.path.lexists(path) else b""
    if (sha256 or data) and hashlib.sha256(data).hexdigest() != sha256:
        raise Refused(f"{path} is not the tokenizer {clip(meta['tokenizer'])} that meta.json records (its sha256 "
                      f"differs): a swapped or stray file; put the dataset's own back, or {redo}")
    text = tokenizer_text(data, str(path), redo) if data else None  # read as a tokenizer: a sha256 vouches for bytes
    if text and tokenizer_problem(text)[1] != meta["vocab_size"]:
        raise Refused(f"{path} has {tokenizer_problem(text)[1]} tokens but meta.json's vocab_size is "
                      f"{meta['vocab_size']}; {redo}")
    if vocab_size is not None and meta["vocab_size"] > vocab_size:
        raise Refused(f"{folder} was tokenised with {clip(meta['tokenizer'])} ({meta['vocab_size']} tokens) but the "
                      f"model's vocab_size is {vocab_size}; match the model to the data")
    return Dataset(meta, text, {name: shard(folder / name, meta, redo, vocab_size) for name in files})


def dataset_meta(folder: Path) -> dict:
    path = folder / "meta.json"
    root = shlex.quote(f"--data_root={folder.parent}")
    redo = f"prepare its corpus again with python prepare.py --dataset=SOURCE {root}"
    meta = parse(read_small(path, MAX_TEXT_BYTES, "dataset file", redo), str(path), redo)
    settings = meta.get("settings") if isinstance(meta, dict) else None
    if isinstance(settings, dict) and isinstance(settings.get("dataset"), str):
        redo = redo.replace("--dataset=SOURCE", shlex.quote(f"--dataset={clip(settings['dataset'], 400)}"))
    version = meta.get("format", meta.get("split_rule", 1)) if isinstance(meta, dict) else DATA_FORMAT
    if version in (1, 2):
        old = {1: "by an older rule that cut every document into train and val",
               2: "before val.bytes (bits per byte) was recorded"}[version]
        raise Refused(f"{folder} was prepared {old}; {redo}")
    if version != DATA_FORMAT:  # the declaration takes a checkpoint's record of an older dataset too
        raise Refused(f"{path}: format is {brief(version)}, not one of: {DATA_FORMAT}; {redo}")
    if why := declared_problem(meta, DatasetMeta) or meta_problem(meta):
        raise Refused(f"{path}: {why}; {redo}")
    sums = meta["checksums"]
    if sorted(sums) != ["train", "val", "val.bytes"] or not all(SHA256.fullmatch(str(v)) for v in sums.values()):
        raise Refused(f"{path}: checksums is {brief(sums)}, not the sha256 of train, val and val.bytes; {redo}")
    return meta


def meta_problem(meta: dict) -> str | None:
    """What a meta.json's (or data_meta's) fields say that cannot be: ids outside its vocabulary, another dtype."""
    vocab = meta.get("vocab_size", BIG)
    ids = [meta.get("eot_token"), meta.get("mask_token"), *(meta.get("special_tokens") or [])]
    if bad := [i for i in ids if i is not None and problem(i, int, 0, vocab - 1)]:
        return f"token id {brief(bad[0])} is not an id of its {vocab} tokens"
    if "dtype" in meta and "vocab_size" in meta and meta["dtype"] != token_dtype(vocab).name:
        return f"dtype is {brief(meta['dtype'])}, but {vocab} tokens are stored as {token_dtype(vocab).name}"
    return None


def shard(path: Path, meta: dict, redo: str, vocab_size: int | None) -> np.memmap:
    """One of a dataset's files as a read-only memmap, checked first (see dataset)."""
    dtype = shard_dtypes(meta["vocab_size"])[path.name]
    count = meta["val_tokens" if path.name == "val.bytes" else f"{path.stem}_tokens"]
    info = os.stat(path) if os.path.exists(path) else None
    if info is None or not stat.S_ISREG(info.st_mode) or info.st_size != count * dtype.itemsize:
        what = "byte counts" if path.name == "val.bytes" else "tokens"
        raise Refused(f"{path} is missing, or not the {count} {dtype.name} {what} meta.json says (truncated or "
                      f"corrupt); {redo}")
    values = np.memmap(path, dtype=dtype, mode="r")
    recorded = meta["checksums"][path.name.removesuffix(".bin")]
    if info.st_size <= MAX_HASHED_BYTES and sha256_of_array(values) != recorded:
        raise Refused(f"{path} does not match the checksum in meta.json (modified or corrupt); {redo}")
    if path.name == "val.bytes" and values.sum(dtype=np.int64) != meta["val_bytes"]:
        raise Refused(f"{path} does not sum to meta.json's val_bytes; {redo}")
    if vocab_size is not None and path.name != "val.bytes" and largest_value(values) >= vocab_size:
        raise Refused(f"{path} holds token id {largest_value(values)} >= vocab_size {vocab_size}; {redo}")
    return values


def sha256_of_array(values: np.ndarray, chunk: int = 1 << 24) -> str:
    sha256 = hashlib.sha256()
    for start in range(0, len(values), chunk):  # bounded memory
        sha256.update(values[start:start + chunk])
    return sha256.hexdigest()


def largest_value(values: np.ndarray, chunk: int = 1 << 24) -> int:
    return max((int(values[start:start + chunk].max()) for start in range(0, len(values), chunk)), default=0)


def same_tokenizer(meta: dict, other: dict) -> bool:
    """Whether two datasets' (or data_meta's) tokenizers are one: by their tokenizer.json's sha256, else by name."""
    return (meta.get("tokenizer_sha256") or meta["tokenizer"]) == (other.get("tokenizer_sha256") or other["tokenizer"])


def special_ids(meta: dict) -> list[int]:
    """The ids of a dataset's special tokens (end-of-text at least), which stand for no text."""
    return list(meta.get("special_tokens") or [meta["eot_token"]])


# ---------------------------------------------------------------------------------------------- safetensors files

CHECKPOINT_KEY = "headless-lm"  # a checkpoint's document in a safetensors file's metadata (checkpoint.py)
# The dtypes a weight may have: another kind of number (an integer, true/false) is refused, never cast into the model
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADER_BYTES = MAX_TEXT_BYTES  # a safetensors header: each tensor's name, dtype, shape and offsets, and the
#   metadata (a checkpoint's document: pythia-70m's with its optimizer, 30 kB)


def safetensors_open(path: str | Path, what: str, fix: str, old: str = "") -> Any:
    """A safetensors file opened by its library (memory-mapped, a tensor read when asked for) through the descriptor
    its checks read, once its first bytes can begin one: a regular file, not sparse, with a header length within
    MAX_HEADER_BYTES and the file. The library checks the rest (the header, each tensor's dtype, shape and bytes
    tiling the data exactly) before a tensor is read. `old`: the fix for a torch.save file (a zip)."""
    from safetensors import safe_open
    f, info = opened(path, what, fix)
    with f:  # one open file, start to end: a file a save renames over `path` meanwhile is never read with this one
        head = f.read(8)
        why = holes_problem(f.fileno(), info.st_size)
        length = int.from_bytes(head.ljust(8, b"\0"), "little")
        if head.startswith(b"PK\x03\x04"):
            raise Refused(f"{what} {path} is a torch.save file (a zip), not safetensors; {old or fix}")
        if len(head) < 8 or length > min(MAX_HEADER_BYTES, info.st_size - 8):
            why = (f"is {info.st_size} bytes, too few for a safetensors file" if len(head) < 8 else
                   f"is not a safetensors file: its first 8 bytes claim a header of {length:,} bytes, more than "
                   + (f"a header can be ({MAX_HEADER_BYTES:,})" if length > MAX_HEADER_BYTES else "the file holds"))
        if why:
            raise Refused(f"{what} {path} {why}; {fix}")
        try:  # by its descriptor: the library opens a name twice (its header, then torch's mapping of the bytes)
            return safe_open(f"/dev/fd/{f.fileno()}", framework="pt")
        except Exception as e:  # SafetensorError: what the header breaks, in one line
            why = first_line(e).removeprefix("Error while deserializing header: ")
            raise Refused(f"{what} {path} is not a valid safetensors file ({clip(why, 120)}): damaged, cut short "
                          f"or not one; {fix}") from None


def holes_problem(fd: int, size: int) -> str | None:
    """Why a file is not the bytes it claims: more than half of it holes (a sparse file, gigabytes of zeros that
    cost nothing on disk and would cost memory once loaded), found by SEEK_DATA/SEEK_HOLE: a few system calls."""
    present, offset = 0, 0
    try:
        for _ in range(1 << 16):  # extents; past them, the part walked is judged
            if offset >= size or 2 * present >= size:
                break
            start = os.lseek(fd, offset, os.SEEK_DATA)
            offset = os.lseek(fd, start, os.SEEK_HOLE)
            present += offset - start
        else:
            size = offset
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: no data past `offset`; otherwise the file system cannot tell
            return None
    finally:
        os.lseek(fd, 0, os.SEEK_SET)
    if 2 * present >= size:
        return None
    return f"is a sparse file: {present:,} of its {size:,} bytes are on disk, the rest holes where data should be"


# ---------------------------------------------------------------------------------------------- settings together


def step_problem(batch_size: Any, grad_accum: Any, block_size: Any) -> str | None:
    """Why a rank's step of batch_size x block_size x grad_accum tokens cannot be: more than MAX_STEP_TOKENS."""
    if not all(isinstance(n, int) for n in (batch_size, grad_accum, block_size)):
        return None  # not known yet, or refused by its own rule
    tokens = batch_size * grad_accum * block_size
    if tokens <= MAX_STEP_TOKENS:
        return None
    return (f"batch_size {batch_size} x block_size {block_size} x grad_accum {grad_accum} is a step of {tokens:,} "
            f"tokens, more than a rank's step can be ({MAX_STEP_TOKENS:,})")


def check_step(batch_size: int, grad_accum: int, block_size: int) -> None:
    """step_problem as a refusal, for a script that knows the three (plan.settle, finetune.py)."""
    if why := step_problem(batch_size, grad_accum, block_size):
        raise Refused(f"{why}; lower --batch_size or --grad_accum (or --block_size)")


def model_config_problem(values: Any, config_class: type, name: str = "model_config") -> str | None:
    """model_config as config_class's fields (field_rules: GPTConfig's types, a Literal's values, their ranges), then
    together: heads that divide the width, rotary channels that fit a head. `name` names the table in the message
    ("": train.py's model settings, checked by the same rules)."""
    if why := fields_problem(values, field_rules(config_class), name):
        return why
    c = config_class(**values)
    head = c.d_model // c.n_head
    table = f"{name}." if name else ""
    if c.d_model % c.n_head:
        return f"{table}d_model {c.d_model} is not a multiple of n_head {c.n_head}"
    if c.rotary_dims + c.rotary_dims % 2 > head:
        return f"{table}rotary_pct {c.rotary_pct} rotates more than a head's {head} channels"
    return None


# ---------------------------------------------------------------------------------------------- line formats

MAX_LINE_BYTES = 1 << 20  # one line of a .jsonl file (a LAMBADA text, a GLUE or XNLI row, a log record: a few kB)
MAX_LINES_BYTES = 1 << 30  # a whole .jsonl file, whose rows a command holds in memory


def jsonl_rows(path: str | Path, what: str, fix: str, cut_ok: bool = False) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a .jsonl file, read line by line within bounds counted as
    the bytes are read (a sparse file's size means nothing): a line of at most MAX_LINE_BYTES (a 3 GB file with
    no newline is refused after 1 MiB), a file of at most MAX_LINES_BYTES; each line strict UTF-8 and JSON, and
    its strings text (no lone surrogate: JSON's "\\ud800" escape makes one). `cut_ok`: a last line without its
    newline that is not a whole row (a crash mid-write) is skipped, not refused."""
    f, _ = opened(path, what, fix)
    read = 0
    with f:
        for number in itertools.count(1):
            line = f.readline(MAX_LINE_BYTES + 1)
            read += len(line)
            if not line:
                return
            where = f"{path} line {number}"
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                raise Refused(f"{where} is longer than {MAX_LINE_BYTES:,} bytes, more than a {what} line can be; {fix}")
            if read > MAX_LINES_BYTES:
                raise Refused(f"{path} is more than {MAX_LINES_BYTES:,} bytes, more than a {what} can be; {fix}")
            try:
                text = line.decode("utf-8")
                value = json_line(text, where, fix) if text.strip() else None
            except UnicodeDecodeError as e:
                if cut_ok and not line.endswith(b"\n"):
                    return
                raise Refused(f"{where} is not UTF-8 text (byte {e.start}); {fix}") from None
            except Refused:
                if cut_ok and not line.endswith(b"\n"):
                    return  # the end of a line a crash cut short
                raise
            if text.strip():
                yield number, value


def json_line(text: str, where: str, fix: str) -> Any:
    """One line of JSON: any way it is broken is one line naming `where`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise Refused(f"{where} is not valid JSON ({e.msg} at column {e.colno}); {fix}") from None
    except ValueError:  # an integer of more than 4300 digits
        raise Refused(f"{where} holds a number too long to read; {fix}") from None
    except RecursionError:
        raise Refused(f"{where} is JSON nested too deeply to be an example; {fix}") from None
    if "\\u" in text and not is_text(value):
        raise Refused(f"{where} holds a lone surrogate (an escaped \\ud800-\\udfff without its pair), which is "
                      f"not text; {fix}")
    return value


def is_text(value: Any) -> bool:
    """Whether every string in a JSON value is Unicode text (encodes as UTF-8: no lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(is_text(k) and is_text(v) for k, v in value.items())
    return all(map(is_text, value)) if isinstance(value, list) else True


# ---------------------------------------------------------------------------------------------- runs' state

@dataclasses.dataclass
class LogRecord:
    """A line of a run's log.jsonl (train.Run.log writes it): its step and tokens counted, the rest plain values
    (metrics: numbers, or null where none was measured)."""
    OTHERS: typing.ClassVar[Any] = bool | float | str | list | None
    step: int = dataclasses.field(metadata=COUNT_RANGE)
    tokens: int = dataclasses.field(metadata=COUNT_RANGE)
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    run_id: str | None = None


def run_log(path: str | Path, cut_ok: bool = False) -> list[dict]:
    """A training run's log.jsonl, each line a LogRecord; `cut_ok`: a line cut short by a crash is dropped (a
    resumed run trims its log). Steps never go back."""
    fix = "move the damaged log away (a run resumed without it starts a new one), or run it again"
    records, step = [], 0
    for number, record in jsonl_rows(path, "run log", fix, cut_ok):
        why = declared_problem(record, LogRecord)
        why = why or next((f"{k} is {brief(v)}, not a number" for k, v in record.items()
                           if k.startswith("val_") and problem(v, (float, None))), None)
        if not why and record["step"] < step:
            why = f"goes back from step {step} to {record['step']}"
        if why:
            raise Refused(f"{path} line {number}: {why}; {fix}")
        step = record["step"]
        records.append(record)
    return records


def results_file(path: str | Path, what: str, declared: type, expected: dict[str, Any]) -> dict:
    """A results file a script reads back as it is (compare.py's result.json of a finished point or size): every
    field as `declared` declares it, and `expected` (what the point or size is): one copied from another is refused."""
    fix = f"delete it to run that {what} again"
    data = read_small(path, MAX_TEXT_BYTES, f"{what}'s result file", fix)
    result = parse(data, f"{path}, not a finished {what}'s results: it", fix)
    why = declared_problem(result, declared)
    why = why or next((f"{'.'.join(map(str, where))} is {brief(v)}, not a finite number"
                       for where, v in numbers(result) if not -1e300 <= v <= 1e300), None)  # as write_json writes
    why = why or next((f"{k} is {brief(result.get(k))}, not {brief(v)}" for k, v in expected.items()
                       if result.get(k) != v or type(result.get(k)) is not type(v)), None)
    if why:
        raise Refused(f"{path} is not a finished {what}'s results: {why}; {fix}")
    return result


def numbers(value: Any, where: tuple = ()) -> Iterator[tuple[tuple, float]]:
    """(path, number) of every number (not a bool) in a JSON value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        yield where, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from numbers(item, (*where, key))
