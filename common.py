"""Run-time plumbing every script shares: settings from flags and files, one-line errors, device and dtype,
several processes under torchrun, atomic writes, and checkpoints. model.py, loss.py and data.py do the work."""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import fcntl
import importlib.util
import json
import math
import os
import re
import socket
import sys
import time
import tomllib
import types
import typing
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Literal

import torch

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "bfloat16", "float16", "float32"]


class UserError(Exception):
    """A mistake the user can fix: scripts print its one-line message, no traceback, and exit 2."""


def run_main(main: Callable[[list[str]], Any]) -> None:
    try:
        main(sys.argv[1:])
        close_distributed()
    except UserError as e:
        print(f"error{f' (rank {rank()})' if world_size() > 1 else ''}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def need_extra(module: str, flag: str) -> None:
    """A flag served by an extra file that a fork deleted is one line, before any work."""
    if importlib.util.find_spec(module) is None:
        raise UserError(f"{flag} needs {module}.py, which is not in this checkout; restore it or drop {flag}")


# ----------------------------------------------------------------------------------------------
# Settings: a dataclass filled from defaults < --config=FILE.json|toml < --key=value flags


def repeatable(**kwargs: Any) -> Any:
    """A list setting given by repeating its flag (--prompt=a --prompt=b); never split on commas."""
    return dataclasses.field(default_factory=list, metadata={"repeatable": True}, **kwargs)


def _coerce(key: str, raw: Any, kind: Any) -> Any:
    """A flag or config value as the field's type, or a UserError saying what is expected."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):  # X | None, or bool | Literal["auto"]
        if type(None) in args and raw in (None, "", "none", "None"):
            return None
        members = [a for a in args if a is not type(None)]
        for member in members:
            with contextlib.suppress(UserError):
                return _coerce(key, raw, member)
        if len(members) == 1:
            return _coerce(key, raw, members[0])  # its own message
        _refuse(key, raw, [c for m in members for c in (["true", "false"] if m is bool else typing.get_args(m))])
    if origin is Literal:
        return raw if raw in args else _refuse(key, raw, args)
    if origin is list:  # comma-separated on the command line, a list in config files
        return [_coerce(key, item, args[0]) for item in (raw if isinstance(raw, list) else
                                                          [s for s in str(raw).split(",") if s])]
    word = str(raw).lower()
    if kind is bool:
        truth = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False}
        return truth[word] if word in truth else _refuse(key, raw, ["true", "false"])
    try:
        value = kind(float(raw)) if kind is int and "e" in word else kind(raw)
        if isinstance(raw, (bool, list, dict)) or kind is int and float(raw) != value:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"--{key}={raw!r} is not a valid {kind.__name__}") from None
    return value


def _refuse(key: str, raw: Any, choices: Any) -> Any:
    raise UserError(f"--{key}={raw!r} is not valid; choose one of: {', '.join(map(str, choices))}")


def _read_config_file(path: str) -> dict[str, Any]:
    """A JSON or TOML file of settings, read as plain data (never executed)."""
    p = Path(path)
    if not p.is_file() or p.suffix not in (".json", ".toml"):
        raise UserError(f"config file {path} not found (or not .json/.toml); pass --config=PATH to one")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else tomllib.loads(p.read_text())
    except (ValueError, RecursionError) as e:  # JSON and TOML errors, bad UTF-8, absurd nesting
        raise UserError(f"config file {path} is not valid {p.suffix[1:].upper()}: {first_line(e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a table of key = value settings")
    return data


def parse_flags(cls: type, argv: list[str], quick: dict[str, Any] | None = None) -> Any:
    """Dataclass `cls` from --key=value flags (a bare --flag is true) and an optional --config file;
    --help lists the settings. With --quick, `quick` replaces the defaults, never what the user gave."""
    hints = typing.get_type_hints(cls)
    if "--help" in argv or "-h" in argv:
        print((sys.modules["__main__"].__doc__ or "").strip() + "\n\nsettings (--key=value):")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            print(f"  --{f.name:<18} {str(hints[f.name]).replace('typing.', ''):<44} default: {default!r}")
        sys.exit(0)
    repeat = {f.name for f in dataclasses.fields(cls) if f.metadata.get("repeatable")}
    flags: dict[str, Any] = {}
    for arg in argv:
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}; settings are given as --key=value")
        key, sep, raw = arg[2:].partition("=")
        key, value = key.replace("-", "_"), raw if sep else "true"
        flags[key] = [*flags.get(key, []), value] if key in repeat else value
    values = {**(_read_config_file(flags.pop("config")) if "config" in flags else {}), **flags}
    for key in values:
        if key not in hints:
            close = difflib.get_close_matches(key, hints, n=1)
            raise UserError(f"unknown setting --{key}; {f'did you mean --{close[0]}? ' if close else ''}"
                            f"valid settings: {', '.join(hints)}")
    if quick and _coerce("quick", values.get("quick", False), bool):
        values = {**quick, **values}
    return cls(**{k: _coerce(k, [v] if k in repeat and isinstance(v, str) else v, hints[k])
                  for k, v in values.items()})


def in_range(cfg: Any, name: str, low: float = -math.inf, high: float = math.inf, ends: str = "[]") -> None:
    """Refuse cfg.<name> (each item of a list; None is unset) if it is not finite or lies outside low..high;
    `ends` says whether each end is included: "[]", "[)", "(]" or "()"."""
    value = getattr(cfg, name)
    for v in [x for x in (value if isinstance(value, list) else [value]) if x is not None]:
        if not math.isfinite(v):
            raise UserError(f"--{name} must be a finite number, got {v}")
        if v < low or v > high or (v == low and ends[0] == "(") or (v == high and ends[1] == ")"):
            shown = (f"in {ends[0]}{low:g}, {high:g}{ends[1]}" if high < math.inf else
                     "positive" if (low, ends[0]) == (0, "(") else f"at least {low:g}")
            raise UserError(f"--{name} must be {shown}, got {v}")


# ----------------------------------------------------------------------------------------------
# Device, precision, and several processes (torchrun: one per GPU; without it, rank 0 of 1)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device=cuda but no CUDA GPU is visible; use --device=auto or --device=cpu")
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 on GPUs that have it, fp16 (with loss scaling) on older ones, fp32 on CPU."""
    if name == "float16" and device.type != "cuda":
        raise UserError("--dtype=float16 needs a CUDA GPU; on CPU use --dtype=float32 or bfloat16")
    if name == "auto" and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32 if name == "auto" else getattr(torch, name)


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the matmuls; the losses upcast their scores to fp32 themselves."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}  # dense bf16 FLOP/s, for MFU


def peak_flops(device: torch.device) -> float | None:
    return peak_flops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_flops_of(gpu_name: str) -> float | None:
    """Whole words of the name ("NVIDIA H100 80GB HBM3"): an L40S is not an L4."""
    return next((v for k, v in PEAK_FLOPS.items() if re.search(rf"\b{re.escape(k)}\b", gpu_name)), None)


def init_distributed(device: torch.device) -> torch.device:
    """Under torchrun, join the process group (NCCL on GPUs, gloo on CPU); returns this rank's device."""
    if not all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        cuda = device.type == "cuda"
        torch.distributed.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return device


def close_distributed() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_main_process() -> bool:
    """Rank 0: the one process that prints progress and writes logs and checkpoints."""
    return rank() == 0


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """The element-wise sum over ranks, in place (NCCL reduces GPU tensors only)."""
    if world_size() > 1:
        torch.distributed.all_reduce(values)
    return values


def count_ranks(flag: bool, device: torch.device) -> int:
    """On how many ranks `flag` holds; every rank gets the same answer."""
    return int(all_reduce_sum(torch.tensor([float(flag)], device=device)).item())


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


# ----------------------------------------------------------------------------------------------
# Files: written whole or not at all, under temp names no user would choose (only ours are swept)

TEMP_MARK = ".headless-lm-"


class DiskFullError(UserError):
    """No space left while writing a file; the partial file is already removed."""


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Write `path` through a temp file beside it, fsync'd and renamed when the block succeeds, removed
    when it fails: readers never see half a file."""
    path = Path(path)
    if path.is_dir() or any(p.exists() and not p.is_dir() for p in path.parents):
        raise UserError(f"cannot write {path}: it is a folder, or a folder above it is a file")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        while e is not None and not (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)):
            e = e.__cause__ or e.__context__  # torch.save wraps the OSError in a RuntimeError
        if e is not None:
            kept = f"{path} is unchanged" if path.exists() else f"no {path} was written"
            raise DiskFullError(f"no space left on device while saving {path}; the partial file was "
                                f"removed and {kept}") from None
        raise


def remove_stale_temps(folder: str | Path) -> None:
    """Delete our temp files whose writer is dead (a kill -9 mid-save); nobody else's files."""
    for tmp in Path(folder).glob(f".*{TEMP_MARK}*.tmp"):
        pid = tmp.name.rsplit(TEMP_MARK, 1)[1].removesuffix(".tmp")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def hold_lock(folder: str | Path, what: str) -> Iterator[None]:
    """An exclusive flock on folder/.lock for the block's life; a second holder is refused in one line
    naming the first. The kernel drops the lock when its process dies: a crash leaves no stale lock."""
    path = Path(folder) / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise UserError(f"{folder} is in use by another {what} ({holder}); wait for it to finish or "
                            "use another folder") from None
        if path.exists() and os.path.samestat(os.fstat(f.fileno()), path.stat()):
            break  # else the last holder removed the file after we opened it: lock the one on disk
        f.close()
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
    f.flush()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # still locked: nobody holds the file we remove
        f.close()


# ----------------------------------------------------------------------------------------------
# Checkpoints: plain data and tensors, read back with weights_only=True (never unpickled code)


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint dict (tensors on CPU, read lazily); `hf:ORG/NAME` or `hf:FOLDER` reads a Hugging Face
    GPT-NeoX model through hf.py."""
    if str(path).startswith("hf:"):
        need_extra("hf", "an hf: source")
        from hf import hf_checkpoint

        return hf_checkpoint(str(path))
    if not Path(path).is_file():
        raise UserError(f"checkpoint {path} not found; train one with `python train.py` or pass --ckpt=PATH")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}); is it a train.py checkpoint?"
                        ) from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) or "model_config" not in ckpt:
        raise UserError(f"{path} is not a headless-lm checkpoint (no model weights); pass a train.py one")
    return ckpt


def checkpoint_model(ckpt: dict, path: str | Path, **overrides: Any):
    """The model of a loaded checkpoint, its weights first checked against its config (no memory used)."""
    from model import GPT, GPTConfig, weights_problem

    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}  # torch.compile's prefix
    try:
        config = GPTConfig(**{**ckpt["model_config"], **overrides})
    except TypeError as e:
        raise UserError(f"{path} does not match this model code: {first_line(e)}") from None
    if problem := weights_problem(config, state):
        raise UserError(f"{path} does not match this model code: {problem}")
    model = GPT(config)
    model.load_state_dict(state)
    return model
