"""A checkpoint's format and the door's checks beyond each field's declaration, generic over the declared class
(checkpoint.Checkpoint, passed in as doors.declared_problem takes it), so that this file imports nothing above it.
A read is one open file, start to end (doors.safetensors_open): a save renaming a new file over the path meanwhile
is never paired with it. Plumbing: a fork that adds a field to checkpoint.py never opens it (docs/hacking.md)."""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
import typing
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

import doors

FIX = "pass a checkpoint that train.py or finetune.py wrote"


# ---------------------------------------------------------------------------------------------- the file

# A checkpoint in safetensors: each tensor of the payload (weights, the objective's pieces, the optimizer's state, the
# random states) by its path in it, "optimizer/state/0/exp_avg"; each text longer than LONG_TEXT (a tokenizer.json)
# as its UTF-8 bytes; the rest, plain JSON with null where a tensor was, one document in the metadata
CHECKSUM_KEY = "headless-lm-crc32"
LONG_TEXT = 1 << 12
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL", torch.complex64: "C64"}


def encode_checkpoint(payload: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A checkpoint's payload as a safetensors file holds it: (tensors by name, metadata), the CRC-32 of both
    (checksum) in the metadata. A tensor sharing another's storage (tied weights) is stored as a copy."""
    tensors: dict[str, torch.Tensor] = {}
    texts: list[str] = []
    storages: set[int] = set()

    def plain(value: Any, path: str) -> Any:
        if isinstance(value, str) and len(value) > LONG_TEXT:
            texts.append(path)
            value = torch.frombuffer(bytearray(value.encode()), dtype=torch.uint8)
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            storage = t.untyped_storage()
            t = t.clone() if storage.nbytes() and storage.data_ptr() in storages else t
            storages.add(t.untyped_storage().data_ptr())
            tensors[path] = t
            return None
        if isinstance(value, dict):
            if bad := next((k for k in value if not isinstance(k, (str, int)) or "/" in str(k)), None):
                raise ValueError(f"{path or 'the checkpoint'} has a key {bad!r}: a key is a name without / or a number")
            return {str(k): plain(v, f"{path}/{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v, f"{path}/{i}") for i, v in enumerate(value)]
        return value

    document = json.dumps({"payload": plain(payload, ""), "texts": texts}, allow_nan=False)
    return tensors, {doors.CHECKPOINT_KEY: document, CHECKSUM_KEY: checksum(document, tensors)}


def checkpoint_bytes(payload: dict) -> Iterator[Any]:
    """A checkpoint file's bytes, in pieces (encode_checkpoint's tensors and metadata, as safetensors lays them out:
    the header's length in 8 bytes, the header, JSON padded with spaces to a multiple of 8, then each tensor's bytes,
    the widest dtypes first, so that each is aligned to its element). Written here, not by the library, so that
    save_checkpoint writes them (safe_files.atomic_file): the library's save_file renames a temp file of its own over
    the path."""
    tensors, metadata = encode_checkpoint(payload)
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name} is a {t.dtype} tensor, which safetensors does not store")
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.numel() * t.element_size()]}
        offset = header[name]["data_offsets"][1]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield len(text).to_bytes(8, "little") + text
    for name in order:
        yield tensors[name].reshape(-1).view(torch.uint8).numpy()


def checksum(document: str, tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 of a checkpoint's document, then of each tensor's name, dtype, shape and bytes, in the order of their
    names: a byte changed anywhere (in a tensor; in the header, which would then read other tensors or settings)
    changes it. zlib reads 2 GB/s: 0.25 s for pythia-70m with its optimizer (bench.py --mode=checkpoint)."""
    crc = zlib.crc32(document.encode())
    for name in sorted(tensors):
        t = tensors[name]
        crc = zlib.crc32(f"{name} {t.dtype} {list(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def open_checkpoint(path: str | Path) -> Any:
    """A checkpoint file opened through the safetensors door, its fix said for a missing or old one."""
    missing = ("train.py writes out/ckpt.safetensors and `finetune.py --ckpt=out/ckpt.safetensors` writes "
               "out-ft/ckpt.safetensors: run the step that makes it, or pass --ckpt=PATH")
    old = (f"this project's checkpoints before safetensors (ckpt.pt) are converted once, a file you trust as your "
           f"own: {convert_command(path)}")
    return doors.safetensors_open(path, "checkpoint", FIX if os.path.exists(path) else missing, old)


def checkpoint_file(path: str | Path, whole: bool = True) -> dict:
    """A checkpoint file's payload, as saved: its bytes through the safetensors door, its checksum, its document;
    then each tensor in its place, a null the document holds for it (its fields: checkpoint.read_checkpoint).
    `whole=False`: the document alone, its nulls left (no tensor read, so no checksum pass)."""
    with open_checkpoint(path) as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()} if whole else {}  # noqa: SIM118
    if doors.CHECKPOINT_KEY not in metadata:
        raise doors.Refused(f"{path} is not a headless-lm checkpoint (a safetensors file without its "
                            f"{doors.CHECKPOINT_KEY} metadata); {FIX}")
    if whole and metadata.get(CHECKSUM_KEY) != checksum(metadata[doors.CHECKPOINT_KEY], tensors):
        raise doors.Refused(f"checkpoint {path} does not match its checksum: a byte changed (a damaged copy); copy "
                            "it again, or resume from a good copy")
    document = doors.parse(metadata[doors.CHECKPOINT_KEY].encode(), f"checkpoint {path}'s document", FIX)
    why = doors.fields_problem(document, {"payload": (dict,), "texts": (list,)}, "its document", ("payload", "texts"))
    payload = document.get("payload") if not why else None
    for name, t in tensors.items() if not why else ():
        if name in document["texts"]:
            t = utf8(t)
        if t is None or not put_back(payload, name, t):
            why = f"tensor {doors.brief(name, 80)} has no place in its document" if t is not None else \
                f"text {doors.brief(name, 80)} is not UTF-8"
            break
    if why:
        raise doors.Refused(f"checkpoint {path}: {why}; {FIX}")
    return payload


def convert_command(path: str | Path) -> str:
    """The command that converts a checkpoint from before safetensors or of an earlier layout (convert.py) into one
    beside it, to paste in a shell anywhere: this interpreter, the script and both files by full path, quoted."""
    old = Path(os.path.abspath(path))
    new = old.with_suffix(".safetensors")
    new = new if new != old else old.with_name(f"{old.stem}-converted.safetensors")
    script = Path(__file__).resolve().with_name("convert.py")
    return shlex.join([sys.executable, str(script), f"--ckpt={old}", f"--out={new}"])


def utf8(t: torch.Tensor) -> str | None:
    try:
        return bytes(t.numpy()).decode("utf-8") if t.dtype == torch.uint8 and t.dim() == 1 else None
    except UnicodeDecodeError:
        return None


def put_back(payload: dict, name: str, value: Any) -> bool:
    """Put a tensor in the place its name says ("optimizer/state/0/exp_avg"), a null the payload holds for it."""
    table, keys = payload, name.split("/")
    for i, key in enumerate(keys):
        if isinstance(table, list) and key.isascii() and key.isdigit() and int(key) < len(table):
            key = int(key)
        elif not isinstance(table, dict) or key not in table:
            return False
        if i == len(keys) - 1:
            if table[key] is not None:
                return False
            table[key] = value
        table = table[key]
    return True


# The marks of this project's earlier checkpoint layouts, which no script reads (convert.py upgrades them): counts
# kept beside `state` or instead of it, an import's `source`, a disabled scaler's {}, a state from before val_step
EARLIER_COUNTS = ("step", "loss", "val", "first_val", "tokens_seen", "flops", "base_tokens", "base_flops")


def earlier_layout(payload: dict) -> str | None:
    """How a checkpoint's payload (or its document) shows an earlier layout; None: today's."""
    if counts := [k for k in EARLIER_COUNTS if k in payload]:
        return f"counts beside its state: {', '.join(counts)}"
    if "source" in payload:
        return "an import's source"
    if isinstance(payload.get("scaler"), dict) and not payload["scaler"]:
        return "a disabled scaler as {}"
    if isinstance(payload.get("state"), dict) and "val_step" not in payload["state"]:
        return "a state without val_step"
    return None


def refuse_earlier_layout(path: str | Path, payload: dict) -> None:
    if how := earlier_layout(payload):
        raise doors.Refused(f"checkpoint {path} is in an earlier layout of this project's ({how}), which no script "
                            f"reads; convert it once: {convert_command(path)}")


# ---------------------------------------------------------------------------------------------- the door's checks


def checkpoint_problem(payload: dict, declared: type, train_class: type | None = None) -> str | None:
    """The first way a checkpoint's payload breaks its declaration (`declared`: checkpoint.Checkpoint), or what its
    fields say together: weights of a floating-point dtype, its settings (settings_problems), data_meta's ids, a
    run's random state and optimizer, an encoder's mask_spec."""
    if why := doors.declared_problem(payload, declared):
        return why
    return next(filter(None, together_problems(payload, declared, train_class)), None)


def together_problems(ckpt: dict, declared: type, train_class: type | None) -> Iterator[str | None]:
    yield from settings_problems(ckpt, declared, train_class)
    if ckpt.get("init") is not None:
        why = doors.model_config_problem(ckpt["init"]["model_config"], model_class(declared))
        yield why and f"init.{why}"
    meta = ckpt.get("data_meta", {})
    yield doors.declared_problem(meta, doors.DatasetMeta, "data_meta", partial=True)
    yield doors.meta_problem(meta) and f"data_meta {doors.meta_problem(meta)}"
    name = meta.get("tokenizer", "")
    if not ckpt.get("tokenizer_json") and (name.endswith(".json") or "/" in name and not name.startswith("hf:")):
        yield (f"data_meta names its tokenizer by a file ({doors.brief(name)}) but the checkpoint does not carry it "
               "(no tokenizer_json), and a path inside a checkpoint is never opened")
    counted = (ckpt.get("state") or {}).get("micro_batches") is not None  # a run's: it can resume
    if counted and (missing := [k for k in ("optimizer", "rng") if ckpt.get(k) is None]):
        yield f"lacks {', '.join(missing)}"
    rng = ckpt.get("rng") or {}
    if "torch" in rng and rng["torch"].shape != torch.get_rng_state().shape:
        yield "rng.torch is not the state of torch's generator"
    yield mask_problem(ckpt)
    if ckpt.get("optimizer") is not None:
        yield optimizer_problem(ckpt["optimizer"])


def settings_problems(ckpt: dict, declared: type, train_class: type | None) -> Iterator[str | None]:
    """What a checkpoint's settings say together: a model_config whose heads divide its width, train_config by
    `train_class`'s fields (a field of none is a plain value), a block within the model's context and a step the
    model can take. Checked by the door and by a plan from its document (read_document) alike."""
    yield doors.model_config_problem(ckpt["model_config"], model_class(declared))
    train = ckpt.get("train_config", {})
    yield doors.fields_problem(train, doors.field_rules(train_class) if train_class else {}, "train_config",
                               others=True)
    block = model_class(declared)(**ckpt["model_config"]).block_size
    if type(train.get("block_size")) is int and train["block_size"] > block:  # a plain value without train_class
        yield f"train_config.block_size is more than the model's {block} tokens of context"
    step = doors.step_problem(train.get("batch_size"), train.get("grad_accum", 1), train.get("block_size") or block)
    yield step and f"train_config: {step}"


def model_class(declared: type) -> type:
    """The model's config class a declared checkpoint names (model.GPTConfig), found without importing model.py."""
    return typing.get_type_hints(declared)["model_config"]


def mask_problem(ckpt: dict) -> str | None:
    """An encoder's mask_spec: there, its ids within the model's and its own vocabulary."""
    spec = ckpt.get("mask_spec")
    if spec is None:
        return "lacks mask_spec" if ckpt.get("train_config", {}).get("objective") == "mlm" else None
    vocab = ckpt["model_config"].get("vocab_size", doors.BIG)
    if spec["mask_token"] >= vocab or spec["vocab_size"] > vocab:
        which = "mask_token" if spec["mask_token"] >= vocab else "vocab_size"
        return f"mask_spec.{which} {spec[which]} is not a token id of the model's {vocab}"
    if bad := [i for i in spec["special_tokens"] if doors.problem(i, int, 0, spec["vocab_size"] - 1)]:
        return f"mask_spec.special_tokens holds {doors.brief(bad[0])}, not a token id of its {spec['vocab_size']}"
    return None


def optimizer_problem(optimizer: Any) -> str | None:
    """The structure of a torch optimizer's state_dict, whichever it is (AdamW, Lion, RMSprop, SGD...): groups of
    settings (numbers, flags, text, null, lists of them) naming each parameter once, and a state for some of them:
    a step count if it keeps one, tensors of a floating-point dtype, plain numbers. Whether the state is finite and
    fits the parameters it will drive is checked before it is loaded (resumable)."""
    if why := doors.fields_problem(optimizer, {"state": (dict,), "param_groups": (list,)}, "optimizer",
                                   ("state", "param_groups")):
        return why
    ids: set[int] = set()
    for i, group in enumerate(optimizer["param_groups"]):
        where = f"optimizer.param_groups.{i}"
        rules = {"params": (list,), "param_names": (list,)}
        if why := doors.fields_problem(group, rules, where, ("params",), others=True):
            return why
        for p in group["params"]:
            if doors.problem(p, int, 0, doors.BIG) or p in ids:
                return f"{where}.params holds {doors.brief(p)}, not the id of a parameter no other group holds"
            ids.add(p)
    for key, entry in optimizer["state"].items():
        where = f"optimizer.state.{doors.brief(key, 20)}"
        if isinstance(key, bool) or key not in ids:
            return f"{where} is the state of no parameter of its groups"
        if not isinstance(entry, dict):
            return f"{where} is {doors.brief(entry)}, not a table"
        for name, value in entry.items():
            if why := state_problem(name, value):
                return f"{where}.{doors.clip(name, 40)} {why}"
    return None


def state_problem(name: str, value: Any) -> str | None:
    """Why a value of a parameter's optimizer state is none an optimizer keeps: its step count a whole number (a
    tensor of one value, or a number), any other tensor floating-point, anything else a plain number or flag."""
    if name == "step":
        count = value.item() if isinstance(value, torch.Tensor) and not value.shape and value.dtype != torch.bool \
            and not value.is_complex() else value
        if doors.problem(count, float, 0, doors.BIG) is None and count == int(count):
            return None
        shown = f"a tensor of shape {list(count.shape)}" if isinstance(count, torch.Tensor) else doors.brief(count)
        return f"is {shown}, not a count of steps"
    if isinstance(value, torch.Tensor):
        return None if value.dtype in doors.WEIGHT_DTYPES else f"is {value.dtype}, not a floating-point tensor"
    return doors.problem(value, (bool, float, None))


def resumable(path: str | Path, ckpt: Any, groups: list[dict] | None = None,
              named: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
    """Refuse a checkpoint its run cannot continue from, before its optimizer state is loaded: weights or optimizer
    state that are not finite (NaNs that would then be blamed on --lr); and, given this run's param_groups (`named`:
    the parameters' names), state for another optimizer or of other parameters (optimizer_fits). Called by
    checkpoint.restore_training, and by last_good_checkpoint without groups."""
    fix = "it is damaged: resume from a good copy, or start a new run from its weights with --init_from"

    def refuse(why: str) -> doors.Refused:
        return doors.Refused(f"checkpoint {path}: {why}; {fix}")

    if ckpt.optimizer is None:
        raise refuse("it holds no optimizer state, so it cannot resume")
    optimizer = ckpt.optimizer
    if groups is not None:
        optimizer_fits(path, optimizer, groups, {id(p): name for name, p in named}, refuse)
    for name, t in ckpt.model.items():
        if not finite(t):
            raise refuse(f"weight {name} is not finite")
    for key, entry in optimizer["state"].items():
        for name, t in entry.items():
            if isinstance(t, torch.Tensor) and not finite(t):
                raise refuse(f"optimizer.state.{key}.{name} is not finite")
            if isinstance(t, torch.Tensor) and SQUARES.search(name) and t.numel() and not bool(t.min() >= 0):
                raise refuse(f"optimizer.state.{key}.{name} is negative, which a mean of squares never is")


# The state tensors torch's optimizers keep as means of squares, by their names (AdamW's exp_avg_sq and
# max_exp_avg_sq, RMSprop's and Adadelta's square_avg): never negative, or the update takes a square root of one
SQUARES = re.compile(r"_sq$|^square_")


def finite(t: torch.Tensor) -> bool:
    """Whether every value of t is finite: two passes, no copy (a NaN fails both comparisons)."""
    return not t.numel() or bool(t.max() < math.inf) and bool(t.min() > -math.inf)


def optimizer_fits(path: str | Path, optimizer: dict, groups: list[dict], names: dict[int, str],
                   refuse: Any) -> None:
    """The saved groups against this run's optimizer's, whichever optimizer it is: as many, of as many parameters;
    no setting this optimizer does not have (another optimizer's state), its flags the same; each state tensor
    shaped like its parameter, or one value (a fused optimizer reads and writes a mismatched buffer past its end)."""
    saved = optimizer["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in groups]:
        raise doors.Refused(f"{path} holds the optimizer of other trainable parameters; resume with the interrupted "
                            "run's settings (--freeze_body, --loss)")
    for i, (old, new) in enumerate(zip(saved, groups)):
        if others := sorted(set(old) - set(new) - {"initial_lr"}):
            raise refuse(f"optimizer.param_groups.{i} has settings {', '.join(others)}, which this run's optimizer "
                         f"has not: the state of another optimizer")
        for key in [k for k in old if isinstance(old[k], bool) and isinstance(new[k], bool) and old[k] != new[k]]:
            raise refuse(f"optimizer.param_groups.{i}.{key} is {old[key]}, but this run's optimizer has {new[key]}")
        for pid, p in zip(old["params"], new["params"]):
            for key, t in optimizer["state"].get(pid, {}).items():
                if isinstance(t, torch.Tensor) and t.shape != p.shape and t.numel() != 1:
                    raise refuse(f"optimizer state {key} of {names.get(id(p), f'parameter {pid}')} has shape "
                                 f"{list(t.shape)}, but the parameter {list(p.shape)}")


def declared_tensors_problem(saved: dict[str, Any], expected: dict[str, torch.Tensor],
                             what: str) -> str | None:
    """Why tensors a checkpoint holds (`what`: "its objective") are not the ones a module declares (names, shapes,
    dtypes): the message is completed by the caller ("... this run's objective declares")."""
    def shown(tensors: dict) -> str:
        return ", ".join(f"{k} {list(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in tensors.items())
    if set(saved) != set(expected):
        held = doors.brief(shown(saved) or "nothing", 200)
        return f"{what} holds {held}, not the {doors.brief(shown(expected) or 'nothing', 200)}"
    bad = {k: v for k, v in saved.items() if v.shape != expected[k].shape or v.dtype != expected[k].dtype}
    if bad:
        theirs = doors.brief(shown({k: expected[k] for k in bad}), 200)
        return f"{what} holds {doors.brief(shown(bad), 200)}, not the {theirs}"
    return None
