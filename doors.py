"""The doors: the one way in for each kind of file this project reads. A door checks the file (a regular one, of
a sane size), then every field's type and range, and against the weights or the data where they constrain it,
before anything is allocated or built, and refuses a bad file in one line that names it and what fixes it.

    checkpoint(path, GPTConfig)    train.py's checkpoints: the zip's directory, then model_config, train_config,
                                   state, rng, data_meta and the tokenizer
    dataset(folder, files)         a prepared dataset: meta.json, tokenizer.json against its hash, the shards
    config_file(path)              --config=FILE.json|toml
    text_file(path, what, fix)     a small text file read whole (generate.py's --prompt_file)

Plumbing a learner may skip. It imports no other file of this project (model.load_model reads through it), so a
refusal is a Refused, a ValueError; the scripts show it as their one-line UserError (common.through_door).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tomllib
import typing
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import torch


class Refused(ValueError):
    """A file refused at its door: the message is one line naming the file, the problem and the fix."""


# What a real model could have: a file that claims more is refused before anything is built (docs/failures.md)
MAXIMA = {"vocab_size": 1 << 22, "block_size": 1 << 20, "n_layer": 1024, "d_model": 1 << 16, "n_head": 1024,
          "mlp_hidden": 1 << 18}
MAX_ROTARY = 1 << 27  # block_size x rotary channels: the rotary tables stay under 1 GiB
MAX_CONFIG_BYTES = 1 << 20  # --config files
MAX_TEXT_BYTES = 16 << 20  # meta.json, prompt files, results files that an output would replace
MAX_TOKENIZER_BYTES = 256 << 20  # a dataset's tokenizer.json (real ones: a few MB)
MAX_PICKLE_BYTES = 256 << 20  # a checkpoint's data.pkl: the structure around the tensors, unpickled whole
MAX_HASHED_BYTES = 2 << 30  # shards up to this size are checked against their sha256 at every start
BIG = 1 << 62  # any count
SHA256 = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------------------------------- small files


def opened(path: str | Path, what: str, fix: str) -> tuple[IO[bytes], os.stat_result]:
    """`path` opened for reading, with its stat, if it is a regular file. Opened without blocking (a FIFO
    would wait for a writer forever), so that its kind is known before a byte is read (/dev/zero never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Refused(f"{what} {path} not found; {fix}") from None
    except OSError as e:
        raise Refused(f"cannot read {what} {path} ({e.strerror}); {fix}") from None
    f = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        f.close()
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, pipe or socket)"
        raise Refused(f"{what} {path} is {kind}; {fix}")
    return f, info


def read_small(path: str | Path, limit: int, what: str, fix: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, refused by its size before it is read."""
    f, info = opened(path, what, fix)
    with f:
        if info.st_size > limit:
            raise Refused(f"{what} {path} is {info.st_size:,} bytes, more than a {what} can be ({limit:,}); {fix}")
        return f.read(limit + 1)


def parse(data: bytes, where: str, fix: str, kind: str = "JSON") -> Any:
    """JSON or TOML read from a file's bytes: any way they are broken is one line."""
    try:
        return json.loads(data) if kind == "JSON" else tomllib.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON, TOML or UTF-8, a 5,000-digit number, absurd nesting
        raise Refused(f"{where} is not valid {kind}: {(str(e).splitlines() or ['?'])[0]}; {fix}") from None


def text_file(path: str | Path, what: str, fix: str) -> str:
    """A small UTF-8 text file read whole (at most MAX_TEXT_BYTES)."""
    try:
        return read_small(path, MAX_TEXT_BYTES, what, fix).decode("utf-8")
    except UnicodeDecodeError as e:
        raise Refused(f"{what} {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


def config_file(path: str | Path) -> dict[str, Any]:
    """A --config file: a table of settings in JSON or TOML, read as plain data (never executed)."""
    fix = "pass --config=PATH to a .json or .toml file of settings"
    if Path(path).suffix not in (".json", ".toml"):
        raise Refused(f"config file {path} is not .json or .toml; {fix}")
    data = read_small(path, MAX_CONFIG_BYTES, "config file", fix)
    values = parse(data, f"config file {path}", fix, Path(path).suffix[1:].upper())
    if not isinstance(values, dict):
        raise Refused(f"config file {path} must hold a table of key = value settings")
    return values


def brief(value: Any, limit: int = 60) -> str:
    """repr(value) cut short, for a value from a file in a one-line message."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more than 4300 digits
        return f"a {type(value).__name__} too long to show"
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------- fields

KIND_NAMES = {int: "a whole number", float: "a number", bool: "true or false", str: "a string", dict: "a table",
              list: "a list", torch.Tensor: "a tensor", None: "null"}


def problem(value: Any, kinds: Any, low: float = -1e300, high: float = 1e300) -> str | None:
    """Why `value` breaks its rule, or None. kinds: a type or a tuple of them (None: may be null; float takes
    whole numbers too; int never takes a bool), or a list of the values allowed. Numbers: in [low, high]."""
    if isinstance(kinds, list):
        fits = isinstance(value, (str, type(None))) and value in kinds
        return None if fits else f"is {brief(value)}, not one of: {', '.join(map(str, kinds))}"
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if value is None and None in kinds:
        return None
    types = tuple(k for k in kinds if k is not None) + ((int,) if float in kinds else ())
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in kinds):
        return f"is {brief(value)}, not {' or '.join(KIND_NAMES[k] for k in kinds)}"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not low <= value <= high:  # NaN too
        return f"is {brief(value)}, outside [{low:g}, {high:g}]"
    return None


def fields_problem(values: Any, rules: dict[str, tuple], name: str = "", needs: tuple = (),
                   others: bool = False) -> str | None:
    """The first way a table (`name`) breaks its rules: not a table, a needed field missing, a field of no rule
    (unless `others`: then a plain value, null, true/false, a number, a string or a list of them), a value that
    breaks its rule."""
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
            return f"{name}.{brief(key)} {why}" if name else f"{brief(key)} {why}"
    return None


# ---------------------------------------------------------------------------------------------- datasets

# meta.json's "format": 1 cut the end off every document for val, 2 held out whole documents, 3 added val.bytes
DATA_FORMAT = 3
META_RULES = {"format": (int,), "tokenizer": (str,), "tokenizer_sha256": ((str, None),), "documents": (int, 0, BIG),
              "vocab_size": (int, 1, MAXIMA["vocab_size"]), "dtype": (str,), "eot_token": (int, 0, BIG),
              "mask_token": ((int, None), 0, BIG), "special_tokens": ((list, None),), "source": (str,),
              "source_id": (str,), "skipped_rows": (int, 0, BIG), "settings": (dict,), "checksums": (dict,),
              "train_tokens": (int, 1, BIG), "val_tokens": (int, 1, BIG), "val_bytes": (int, 0, BIG)}
META_NEEDS = ("tokenizer", "vocab_size", "dtype", "eot_token", "train_tokens", "val_tokens", "val_bytes", "checksums")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)  # uint16 halves disk and RAM


def shard_dtypes(vocab_size: int) -> dict[str, np.dtype]:
    """The files of a prepared dataset, each an array of this dtype: the token ids of each split, and the
    UTF-8 bytes each validation token stands for (a count can exceed 65,535 where a tokenizer drops text)."""
    return {"train.bin": token_dtype(vocab_size), "val.bin": token_dtype(vocab_size), "val.bytes": np.dtype(np.uint32)}


class Shard:
    """Appends values to an open shard file, counting, summing and hashing them as it goes (data.prepare)."""

    def __init__(self, file: IO[bytes], dtype: np.dtype):
        self.file = file
        self.dtype = dtype
        self.tokens = 0
        self.total = 0
        self.sha256 = hashlib.sha256()

    def write(self, values: np.ndarray) -> None:
        data = values.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(values)
        self.total += int(values.sum(dtype=np.int64))


@dataclass
class Dataset:
    """A prepared dataset as its door let it in: meta.json, the text of its tokenizer.json (None for a
    tiktoken tokenizer), and the files asked for, as read-only memmaps."""
    meta: dict
    tokenizer_json: str | None = None
    arrays: dict[str, np.memmap] = field(default_factory=dict)


def dataset(folder: str | Path, files: tuple[str, ...] = (), vocab_size: int | None = None) -> Dataset:
    """A prepared dataset folder through its door: meta.json (its format, every field's type and range, the
    dtype its vocabulary implies), tokenizer.json against the sha256 meta.json records, then each of `files`
    (train.bin, val.bin, val.bytes): it must hold meta.json's count of values, match its sha256 (up to
    MAX_HASHED_BYTES: more would cost seconds at every start) and, given the model's vocab_size, hold no id
    beyond it; val.bytes must sum to val_bytes."""
    folder = Path(folder)
    meta = dataset_meta(folder)
    redo = f"prepare the dataset again: python data.py --dataset={meta.get('settings', {}).get('dataset', '...')}"
    path = folder / "tokenizer.json"
    text = None
    if meta.get("tokenizer_sha256") is None and os.path.lexists(path):
        raise Refused(f"{path} is not this dataset's: its meta.json records tokenizer {meta['tokenizer']} and no "
                      f"tokenizer.json; remove the file, or {redo}")
    if meta.get("tokenizer_sha256") is not None:
        data = read_small(path, MAX_TOKENIZER_BYTES, "tokenizer file", redo)
        if hashlib.sha256(data).hexdigest() != meta["tokenizer_sha256"]:
            raise Refused(f"{path} is not the tokenizer this dataset was tokenised with (its sha256 is not the one "
                          f"meta.json records); put that one back, or {redo}")
        text = data.decode("utf-8")
    if vocab_size is not None and meta["vocab_size"] > vocab_size:
        raise Refused(f"{folder} was tokenised with {meta['tokenizer']} ({meta['vocab_size']} tokens) but the "
                      f"model's vocab_size is {vocab_size}; match the model to the data")
    return Dataset(meta, text, {name: shard(folder / name, meta, redo, vocab_size) for name in files})


def dataset_meta(folder: Path) -> dict:
    path = folder / "meta.json"
    redo = f"prepare its corpus again with python data.py --dataset=SOURCE --data_root={folder.parent}"
    meta = parse(read_small(path, MAX_TEXT_BYTES, "dataset file", redo), str(path), redo)
    settings = meta.get("settings") if isinstance(meta, dict) else None
    if isinstance(settings, dict) and isinstance(settings.get("dataset"), str):
        redo = redo.replace("SOURCE", settings["dataset"])
    version = meta.get("format", meta.get("split_rule", 1)) if isinstance(meta, dict) else DATA_FORMAT
    if version in (1, 2):
        old = {1: "by an older rule that cut every document into train and val",
               2: "before val.bytes (bits per byte) was recorded"}[version]
        raise Refused(f"{folder} was prepared {old}; {redo}")
    if why := fields_problem(meta, META_RULES, META_NEEDS, others=True) or meta_problem(meta):
        raise Refused(f"{path}: {why}; {redo}")
    if version != DATA_FORMAT:
        raise Refused(f"{path} is of format {version}, which this code does not read (it reads {DATA_FORMAT}); {redo}")
    sums = meta["checksums"]
    if sorted(sums) != ["train", "val", "val.bytes"] or not all(SHA256.fullmatch(str(v)) for v in sums.values()):
        raise Refused(f"{path}: checksums is {brief(sums)}, not the sha256 of train, val and val.bytes; {redo}")
    return meta


def meta_problem(meta: dict) -> str | None:
    """What a meta.json's (or a checkpoint's data_meta's) fields say that cannot be: token ids outside its
    vocabulary, a dtype other than the one the vocabulary implies, a tokenizer hash that is not a sha256."""
    vocab = meta.get("vocab_size", BIG)
    ids = [meta.get("eot_token"), meta.get("mask_token"), *(meta.get("special_tokens") or [])]
    if bad := [i for i in ids if i is not None and problem(i, int, 0, vocab - 1)]:
        return f"token id {brief(bad[0])} is not an id of its {vocab} tokens"
    if "dtype" in meta and "vocab_size" in meta and meta["dtype"] != token_dtype(vocab).name:
        return f"dtype is {brief(meta['dtype'])}, but {vocab} tokens are stored as {token_dtype(vocab).name}"
    if meta.get("tokenizer_sha256") is not None and not SHA256.fullmatch(meta["tokenizer_sha256"]):
        return f"tokenizer_sha256 is {brief(meta['tokenizer_sha256'])}, not a sha256"
    return None


def shard(path: Path, meta: dict, redo: str, vocab_size: int | None) -> np.memmap:
    """One of a dataset's files as a read-only memmap, checked first (see dataset)."""
    dtype = shard_dtypes(meta["vocab_size"])[path.name]
    count = meta["val_tokens" if path.name == "val.bytes" else f"{path.stem}_tokens"]
    try:
        info = os.stat(path)
    except OSError:
        info = None
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


# ---------------------------------------------------------------------------------------------- checkpoints

COUNT = (int, 0, BIG)
METRICS = ((dict, None),)  # of numbers
CHECKPOINT_RULES = {"model": (dict,), "model_config": (dict,), "objective": (dict,), "optimizer": (dict,),
                    "scaler": ((dict, None),), "train_config": (dict,), "state": (dict,), "step": COUNT,
                    "loss": ((float, None),), "val": METRICS, "first_val": METRICS, "tokens_seen": COUNT,
                    "flops": (float, 0), "base_tokens": COUNT, "base_flops": (float, 0), "data_meta": (dict,),
                    "mask_spec": ((dict, None),), "tokenizer_json": ((str, None),), "mix": METRICS, "rng": (dict,)}
STATE_RULES = {"step": COUNT, "micro_batches": COUNT, "tokens": COUNT, "flops": (float, 0), "earlier_tokens": COUNT,
               "earlier_flops": (float, 0), "loss": ((float, None),), "first_val": METRICS, "val": METRICS,
               "val_step": ((int, None), 0, BIG)}
# The settings a script takes from a checkpoint's train_config (finetune.py inherits some); any other is plain
TRAIN_RULES = {"dataset": ((str, None),), "preset": ((str, None),), "block_size": ((int, None), 2, BIG),
               "batch_size": (int, 1, BIG), "grad_accum": (int, 1, BIG), "eval_batches": (int, 1, BIG),
               "max_iters": (int, 1, BIG), "warmup_iters": ((int, None), 0, BIG), "lr": (float, 0),
               "min_lr": ((float, None), 0), "temperature": (float, 1e-3, 1e3), "mix_alpha": ((float, None), 0),
               "objective": (["causal", "mlm"],), "loss": (str,), "device": (["auto", "cpu", "cuda", None],),
               "dtype": (["auto", "bfloat16", "float16", "float32", None],), "compile": ((bool, None),)}
MODEL_RANGES = {**{name: (1, most) for name, most in MAXIMA.items()}, "dropout": (0, 0.999999),
                "rotary_pct": (0, 1), "norm_eps": (1e-30, 1), "rope_base": (1, 1e12)}


def checkpoint(path: str | Path, config_class: type) -> dict:
    """A train.py or finetune.py checkpoint through its door. The file: a regular one, whose zip directory is
    what torch.save writes (every entry stored, within the file, one data.pkl of at most MAX_PICKLE_BYTES), read
    before anything is unpickled; then torch.load(weights_only=True: never code; mmap: the tensors stay on disk);
    then every field: the weights (tensors), model_config (config_class's fields, of their types, within MAXIMA,
    heads that divide the width, rotary tables that fit), train_config (block_size within the model's), state,
    rng, data_meta, and the tokenizer it carries (against data_meta's sha256)."""
    fix = "pass a checkpoint that train.py or finetune.py wrote"
    f, info = opened(path, "checkpoint", "train one with `python train.py` or pass --ckpt=PATH")
    with f:
        why = zip_problem(f, info.st_size)
    if why:
        raise Refused(f"checkpoint {path} {why}; {fix}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise Refused(f"cannot read checkpoint {path} ({type(e).__name__}); is it a train.py checkpoint?") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) or "model_config" not in ckpt:
        raise Refused(f"{path} is not a headless-lm checkpoint (no model weights); pass a train.py one")
    if why := next(filter(None, checkpoint_problems(ckpt, config_class)), None):
        raise Refused(f"checkpoint {path}: {why}; {fix}")
    return ckpt


def zip_problem(f: IO[bytes], size: int) -> str | None:
    """Why a file is not what torch.save writes, from its zip directory alone (nothing is decompressed)."""
    try:
        entries = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return "is not a torch.save file (it has no zip directory)"
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED:
            return f"holds a compressed entry ({brief(entry.filename)}), which torch.save never writes"
        if entry.header_offset + entry.file_size > size:
            return f"holds an entry ({brief(entry.filename)}) larger than the file"
    pickles = [e.file_size for e in entries if e.filename.endswith("/data.pkl")]
    if len(pickles) != 1 or pickles[0] > MAX_PICKLE_BYTES:
        return f"does not hold one data.pkl of at most {MAX_PICKLE_BYTES >> 20} MiB, as torch.save writes"
    return None


def checkpoint_problems(ckpt: dict, config_class: type) -> Iterator[str | None]:
    """Each way a loaded checkpoint may break its rules, in order (a check may rely on the ones before it); a
    checkpoint that can resume (it has a state) carries the optimizer and the random state too."""
    yield fields_problem(ckpt, CHECKPOINT_RULES, "", ("optimizer", "rng") if "state" in ckpt else (), others=True)
    for key in ("model", "objective"):
        tensors = ckpt.get(key, {})
        yield fields_problem(tensors, dict.fromkeys(tensors, (torch.Tensor,)), key)
    yield model_config_problem(ckpt["model_config"], config_class)
    yield fields_problem(ckpt.get("train_config", {}), TRAIN_RULES, "train_config", others=True)
    yield fields_problem(ckpt.get("state", {}), STATE_RULES, "state")
    yield fields_problem(ckpt.get("data_meta", {}), META_RULES, "data_meta", others=True)
    for name, table in [(k, ckpt.get(k)) for k in ("val", "first_val", "mix")] + [
            (f"state.{k}", ckpt.get("state", {}).get(k)) for k in ("val", "first_val")]:
        yield fields_problem(table or {}, dict.fromkeys(table or {}, (float,)), name)
    yield rng_problem(ckpt.get("rng"))
    meta = ckpt.get("data_meta", {})
    yield meta_problem(meta) and f"data_meta {meta_problem(meta)}"
    model = ckpt["model_config"]
    if meta.get("vocab_size", 0) > model.get("vocab_size", BIG):
        yield f"data_meta says {meta['vocab_size']} tokens but the model has {model['vocab_size']}"
    if (ckpt.get("train_config", {}).get("block_size") or 0) > model.get("block_size", BIG):
        yield f"train_config.block_size is more than the model's {model['block_size']} tokens of context"
    if "state" in ckpt and ckpt["state"].get("step") != ckpt.get("step"):
        yield f"state.step {brief(ckpt['state'].get('step'))} is not its step {brief(ckpt.get('step'))}"
    text = ckpt.get("tokenizer_json")
    if text is not None and meta.get("tokenizer_sha256") not in (None, hashlib.sha256(text.encode()).hexdigest()):
        yield "the tokenizer it carries is not the one data_meta.tokenizer_sha256 names"


def rng_problem(rng: dict | None) -> str | None:
    """The random state a resumed run restores: torch's generator state exactly, and CUDA's if any."""
    size = torch.get_rng_state().numel()
    rules = {"torch": (torch.Tensor,), "cuda": ((torch.Tensor, None),)}
    if rng is None or (why := fields_problem(rng, rules, "rng", ("torch",))):
        return None if rng is None else why
    if any(t is not None and t.dtype != torch.uint8 for t in rng.values()) or rng["torch"].numel() != size:
        return f"rng.torch is not the {size} bytes of torch's generator state (or rng.cuda not bytes)"
    return None


def model_config_problem(values: Any, config_class: type) -> str | None:
    """model_config as config_class's fields (GPTConfig: of its types, a Literal's values, within MAXIMA), then
    what the fields say together: heads that divide the width, rotary channels that fit in a head, and rotary
    tables (block_size x rotary channels, which no weight checks) of a sane size."""
    rules = {}
    for name, hint in typing.get_type_hints(config_class).items():
        args = typing.get_args(hint)
        kinds = list(args) if typing.get_origin(hint) is Literal else tuple(a if a is not type(None) else None
                                                                            for a in args) or hint
        rules[name] = (kinds, *MODEL_RANGES.get(name, ()))
    if why := fields_problem(values, rules, "model_config"):
        return why
    c = config_class(**values)
    head = c.d_model // c.n_head
    if c.d_model % c.n_head:
        return f"model_config.d_model {c.d_model} is not a multiple of n_head {c.n_head}"
    if c.rotary_dims + c.rotary_dims % 2 > head:
        return f"model_config.rotary_pct {c.rotary_pct} rotates more than a head's {head} channels"
    if c.block_size * c.rotary_dims > MAX_ROTARY:
        return f"model_config.block_size {c.block_size} needs rotary tables over 1 GiB; no model has that much context"
    return None
