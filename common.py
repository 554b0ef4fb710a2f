"""Run-time plumbing every script shares: flags and config files, one-line user errors, device and dtype,
atomic writes, and checkpoints (save, and load with every format check in one place).

model.py, loss.py and data.py do the work; this file only connects them to a command line and a disk.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import fcntl
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import tomllib
import types
import typing
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator, Literal

import torch

if TYPE_CHECKING:  # data.py uses this file too, and knows no model
    from model import GPT

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "bfloat16", "float16", "float32"]


# ----------------------------------------------------------------------------------------------
# Errors and the command line


class UserError(Exception):
    """A mistake the user can fix. Scripts print its one-line message (no traceback), exit 2."""


def run_main(main: Callable[[list[str]], Any]) -> None:
    """Run a script's main(argv): user mistakes become one line on stderr and exit code 2."""
    try:
        main(sys.argv[1:])
        close_distributed()  # only after success: a failed rank just exits, and torchrun stops the others
    except UserError as e:
        where = f" (rank {rank()})" if world_size() > 1 else ""
        print(f"error{where}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, for one-line errors about a library's failure."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def repeatable(**kwargs: Any) -> Any:
    """A list setting given by repeating its flag (`--prompt=a --prompt=b`); values are never split on
    commas, unlike other list settings (`--vocab=8192,50304`)."""
    return dataclasses.field(default_factory=list, metadata={"repeatable": True}, **kwargs)


def _choices(kinds: tuple | list) -> list[str]:
    """The values a union of bool and Literals accepts (`bool | Literal["auto"]`: true, false, auto)."""
    return [str(c) for k in kinds for c in (("true", "false") if k is bool else typing.get_args(k))]


def _coerce(key: str, raw: Any, kind: Any) -> Any:
    """Convert a flag or config value to the dataclass field's type, or explain what is expected."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        if raw not in args:
            raise UserError(f"--{key}={raw!r} is not valid; choose one of: {', '.join(map(str, args))}")
        return raw
    if origin in (typing.Union, types.UnionType):  # X | None, or bool | Literal["auto"]: the first that fits
        if type(None) in args and raw in (None, "", "none", "None"):
            return None
        members = [a for a in args if a is not type(None)]
        for member in members[:-1]:
            with contextlib.suppress(UserError):
                return _coerce(key, raw, member)
        try:
            return _coerce(key, raw, members[-1])
        except UserError:
            if len(members) == 1:
                raise
        choices = ", ".join(_choices(members))
        raise UserError(f"--{key}={raw!r} is not valid; choose one of: {choices}") from None
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
        except (TypeError, ValueError, OverflowError):
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
        raise UserError(f"config file {path} not found; "
                        "pass --config=PATH to an existing .json or .toml file")
    if p.suffix not in (".json", ".toml"):
        raise UserError(f"config file {path} must end in .json or .toml")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else tomllib.loads(p.read_text())
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"config file {path} is not valid {p.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a table of key = value settings")
    return data


def flags_help(cls: type) -> str:
    """The running script's docstring, then every setting with its type and default."""
    hints = typing.get_type_hints(cls)
    lines = [(sys.modules["__main__"].__doc__ or "").strip(), "", "settings (--key=value):"]
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        optional = type(None) in typing.get_args(kind)
        if optional:
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # bool | Literal["auto"]
            choices = _choices(typing.get_args(kind))
        shown = "|".join(map(str, choices)) if choices else getattr(kind, "__name__", str(kind))
        shown += " (or none)" if optional else " (repeat the flag)" if f.metadata.get("repeatable") else ""
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  --{f.name:<16} {shown:<28} default: {default!r}")
    return "\n".join(lines)


def read_flags(cls: type, argv: list[str]) -> dict[str, Any]:
    """The raw settings of a command line: `--config=FILE` values, overridden by `--key=value` flags.

    A bare `--flag` means true; a repeatable setting collects every occurrence. `--help` prints the
    settings and exits. Values are checked by `build_config`.
    """
    if "--help" in argv or "-h" in argv:
        print(flags_help(cls))
        sys.exit(0)
    repeat = {f.name for f in dataclasses.fields(cls) if f.metadata.get("repeatable")}
    flags: dict[str, Any] = {}
    for arg in argv:
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}; settings are given as --key=value")
        key, sep, raw = arg[2:].partition("=")
        key, value = key.replace("-", "_"), raw if sep else "true"
        flags[key] = [*flags.get(key, []), value] if key in repeat else value
    values = _read_config_file(flags.pop("config")) if "config" in flags else {}
    return {**values, **flags}


def build_config(cls: type, values: dict[str, Any]) -> Any:
    """Dataclass `cls` from raw settings. Unknown keys and values of the wrong type or outside a
    Literal's choices are UserErrors that name the valid options."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    repeat = {f.name for f in dataclasses.fields(cls) if f.metadata.get("repeatable")}
    checked = {}
    for key, raw in values.items():
        if key in repeat and isinstance(raw, str):  # one value from a config file
            raw = [raw]
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean --{close[0]}? " if close else ""
            raise UserError(f"unknown setting --{key}; {hint}valid settings: {', '.join(names)}")
        checked[key] = _coerce(key, raw, hints[key])
    return cls(**checked)


def parse_flags(cls: type, argv: list[str], quick: dict[str, Any] | None = None) -> Any:
    """Build dataclass `cls` from `--key=value` flags and an optional `--config=file.json|toml`
    (precedence: dataclass defaults < config file < command-line flags). With `--quick`, the `quick`
    settings replace the defaults, never a value the user gave."""
    values = read_flags(cls, argv)
    cfg = build_config(cls, values)
    if quick and getattr(cfg, "quick", False):
        cfg = build_config(cls, {**quick, **values})
    return cfg


_INTERVAL = re.compile(r"([\[(])\s*([^,]+?)\s*,\s*([^\])]+?)\s*([\])])")


def _bound(cfg: Any, text: str) -> tuple[float | None, str]:
    """A range bound: a number, inf, or the value of another field (None when that field is unset)."""
    if re.fullmatch(r"[a-z_][a-z0-9_]*", text) and text not in ("inf",):
        value = getattr(cfg, text)
        return value, f"--{text}={value}"
    return float(text), text


def check_ranges(cfg: Any, ranges: dict[str, str]) -> None:
    """Refuse, in one line, a number of `cfg` that is not finite or lies outside its declared range.

    `ranges` maps a field to an interval: "[1, inf)", "(0, inf)", "[0, 1)", "[0, lr]" (a bound may name
    another field). Unset (None) values are skipped and lists are checked item by item. Every float field
    must be finite, whether listed or not."""
    def items(name: str) -> list[Any]:
        value = getattr(cfg, name)
        return [v for v in (value if isinstance(value, list) else [value]) if v is not None]

    for f in dataclasses.fields(cfg):
        for value in items(f.name):
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"--{f.name} must be a finite number, got {value}")
    for name, spec in ranges.items():
        opening, low_text, high_text, closing = _INTERVAL.fullmatch(spec).groups()
        (low, low_shown), (high, high_shown) = _bound(cfg, low_text), _bound(cfg, high_text)
        for value in items(name):
            too_low = low is not None and (value < low or (value == low and opening == "("))
            too_high = high is not None and (value > high or (value == high and closing == ")"))
            if too_low or too_high:
                shown = _describe_range(opening, low_shown, high_shown, closing)
                raise UserError(f"--{name} must be {shown}, got {value}")


def _describe_range(opening: str, low: str, high: str, closing: str) -> str:
    if high == "inf":
        if (opening, low) == ("(", "0"):
            return "positive"
        return f"at least {low}" if opening == "[" else f"above {low}"
    return f"in {opening}{low}, {high}{closing}"


# ----------------------------------------------------------------------------------------------
# Device and precision


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device=cuda but no CUDA GPU is visible; use --device=auto or --device=cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 on GPUs that have it, fp16 (with loss scaling) on older ones, fp32 on CPU by default."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name == "float16" and device.type != "cuda":
        raise UserError("--dtype=float16 needs a CUDA GPU; on CPU use --dtype=float32 or bfloat16")
    return getattr(torch, name)


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision for matmuls; the losses upcast their scores to fp32 themselves."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def optimizer_step(optimizer: torch.optim.Optimizer, parameters: Any, grad_clip: float = 1.0,
                   scaler: torch.amp.GradScaler | None = None) -> None:
    """Clip the gradient norm (0: off), step, and reset the gradients. With an fp16 GradScaler the
    gradients are unscaled first and a step whose gradients overflowed is skipped."""
    scaler = scaler or torch.amp.GradScaler(enabled=False)  # enabled=False: plain clip and step
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


# Dense bf16 peak FLOP/s, for MFU. Add your GPU here if it is missing.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}


def peak_flops(device: torch.device) -> float | None:
    return peak_flops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_flops_of(gpu_name: str) -> float | None:
    """Match whole words of the name ("NVIDIA H100 80GB HBM3"): an L40S is not an L4."""
    return next((v for k, v in PEAK_FLOPS.items() if re.search(rf"\b{re.escape(k)}\b", gpu_name)), None)


def format_metric(value: float, digits: int = 4) -> str:
    """A metric for a progress line: fixed-point, but never hundreds of digits (a perplexity capped at
    e^700 would print 304 of them)."""
    return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.{digits}g}"


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return (f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600
            else f"{seconds // 60}m{seconds % 60:02d}s")


# ----------------------------------------------------------------------------------------------
# Several processes: data parallelism under torchrun. Without torchrun's environment variables every
# function here is a no-op for one process (rank 0 of 1) and no process group is ever created.


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(device: torch.device) -> torch.device:
    """Join torchrun's process group (once per process: NCCL on CUDA, gloo on CPU); returns this rank's
    device: its own GPU (cuda:LOCAL_RANK) on CUDA, the CPU otherwise."""
    if not launched_by_torchrun():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        if device.type == "cuda":
            torch.distributed.init_process_group("nccl", device_id=device)
        else:
            torch.distributed.init_process_group("gloo")
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
    """The element-wise sum over all ranks (in place; a no-op for one process)."""
    if world_size() > 1:
        torch.distributed.all_reduce(values)
    return values


def count_ranks(flag: bool) -> int:
    """On how many ranks `flag` is true: every rank gets the same answer."""
    if world_size() == 1:
        return int(flag)
    nccl = torch.distributed.get_backend() == "nccl"  # NCCL reduces tensors on the GPU only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return int(all_reduce_sum(torch.tensor([int(flag)], device=device)).item())


def any_rank(flag: bool) -> bool:
    return count_ranks(flag) > 0


def barrier() -> None:
    """Wait until every rank gets here."""
    if world_size() > 1:
        torch.distributed.barrier()


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block before the other ranks do (it prepares a dataset they then read)."""
    if not is_main_process():
        barrier()
    yield
    if is_main_process():
        barrier()


class ForwardWith(torch.nn.Module):
    """`fn(model, *args)` as the forward of a module that holds `model`. DistributedDataParallel syncs the
    gradients of what runs through its wrapped module's forward, so it must wrap the whole objective
    (hidden states, then the loss against the embeddings), not `model.forward` (which returns logits)."""

    def __init__(self, model: torch.nn.Module, fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args: Any) -> torch.Tensor:
        return self.fn(self.model, *args)


def data_parallel(model: torch.nn.Module, fn: Callable[..., torch.Tensor]) -> torch.nn.Module:
    """`fn(model, *args)` as a module: under torchrun wrapped in DistributedDataParallel, which starts
    every rank from rank 0's weights and averages the gradients over ranks during backward."""
    module = ForwardWith(model, fn)
    if not torch.distributed.is_initialized():
        return module
    return torch.nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=True)


def gradient_sync(module: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """The context of a backward pass: `sync=False` skips DDP's gradient all-reduce (every micro-step
    of gradient accumulation but the last one sums locally, then one all-reduce sums them all)."""
    if sync or not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return module.no_sync()


# ----------------------------------------------------------------------------------------------
# Files


class DiskFullError(UserError):
    """No space left on the device while writing a file; the partial file is already removed."""


def is_disk_full(e: BaseException | None) -> bool:
    """ENOSPC or EDQUOT anywhere in the exception's chain (torch.save wraps the OSError in a RuntimeError)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def check_output_path(path: str | Path, flag: str) -> None:
    """Refuse, before any work, an output file that could never be written (a directory, say)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--{flag}={path} is a directory; pass a file path such as {path / 'results.json'}")
    if any(p.exists() and not p.is_dir() for p in path.parents):
        raise UserError(f"--{flag}={path}: a parent of it is a file, not a folder")


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """A file to write `path` through: a temp file, fsync'd and renamed to `path` when the block ends
    without error, deleted when it fails. Readers never see a half-written file, and the temp name
    carries the process id, so two writers never share one. A full disk is a DiskFullError."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"cannot write {path}: it is a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name says the file is complete
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            kept = f"{path} is unchanged" if path.exists() else f"no {path} was written"
            raise DiskFullError(f"no space left on device while saving {path}; the partial file was removed "
                                f"and {kept}") from None
        raise


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """Delete the temp files (`NAME.PID.tmp`) that `atomic_file` calls of dead processes left behind
    (a kill -9 mid-save); a live process's are kept. Returns the files removed."""
    removed = []
    for tmp in Path(folder).glob("*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2] if tmp.name.count(".") >= 2 else ""
        if pid.isdigit() and not _process_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


LOCK_NAME = ".lock"


@contextlib.contextmanager
def hold_lock(folder: str | Path, what: str = "folder") -> Iterator[Path]:
    """Hold an exclusive lock on `folder` (an fcntl.flock on folder/.lock) for the block's life.

    A second holder is refused at once with a one-line error naming the first (pid, host, start time).
    The kernel drops the lock when its process dies, so a crashed run never leaves a stale lock; the
    file itself is removed on release."""
    path = Path(folder) / LOCK_NAME
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
                            f"use another folder") from None
        # The holder before us may have removed the file after we opened it: lock the file on disk.
        if path.exists() and os.path.samestat(os.fstat(f.fileno()), path.stat()):
            break
        f.close()
    try:
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n")
        f.flush()
        yield path
    finally:
        path.unlink(missing_ok=True)  # while still locked: nobody can have locked the file we remove
        f.close()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM received inside the block are handled when it ends, so a second Ctrl-C waits
    for a save to finish instead of breaking it (and torch's writer would turn it into a RuntimeError)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in received:
            signal.raise_signal(sig)  # now handled as usual


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)


def write_json(path: str | Path, obj: Any) -> None:
    """A results file (--json=PATH), written atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, default=str) + "\n")
    print(f"results written to {path}", file=sys.stderr)


def save_figure(fig: Any, path: str | Path) -> None:
    """A matplotlib figure as an image file (the format from its extension), written atomically."""
    with atomic_file(path) as f:
        fig.savefig(f, format=Path(path).suffix[1:] or "png", dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def save_results(result: dict, json_path: str, plot_path: str, plot: Callable[[dict, str], None]) -> None:
    """The --json and --plot outputs of a measuring script (bench.py, compare.py)."""
    if json_path:
        write_json(json_path, result)
    if plot_path:
        plot(result, plot_path)


def import_pyplot():
    """matplotlib is an optional extra (--plot): a clear one-line UserError without it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib, an optional extra: pip install matplotlib") from None
    return plt


# ----------------------------------------------------------------------------------------------
# Checkpoints: a dict of plain data and tensors, read back with weights_only=True (never unpickled code)


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Write a checkpoint atomically, signals deferred. Refused (UserError, the previous file untouched)
    when its weights, its training loss (`payload["loss"]`) or its validation metrics are not finite, or
    when the disk is full."""
    path = Path(path)
    if problem := non_finite(payload):
        raise UserError(f"not saving {path}: {problem} at step {payload.get('step', '?')}; "
                        f"{last_good_checkpoint(path)}. Lower --lr or raise --warmup_iters")
    try:
        with signals_deferred(), atomic_file(path) as f:
            torch.save(payload, f)
    except DiskFullError:
        raise DiskFullError(f"no space left on device while saving {path} (the partial file was removed); "
                            f"{last_good_checkpoint(path)}. Free some space, then continue with --resume"
                            ) from None


def non_finite(payload: dict) -> str | None:
    """What is not finite in a checkpoint payload (the first weight, the loss, a metric), or None."""
    for name, tensor in payload["model"].items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"weight {name} is not finite"
    loss = payload.get("loss")
    if loss is not None and not math.isfinite(loss):
        return f"the training loss is {loss}"
    for key, value in (payload.get("val") or {}).items():
        if not math.isfinite(value):
            return f"{key} is {value}"
    return None


def last_good_checkpoint(path: Path) -> str:
    """Where the user can continue from after a refused or failed save."""
    if not path.is_file():
        return "there is no earlier checkpoint"
    try:
        step = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("step", "?")
    except Exception:
        return f"{path} is unreadable"
    return f"the last good checkpoint is {path} (step {step})"


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint dict (tensors on CPU, read lazily), with a one-line error for a missing or foreign file.
    `hf:ORG/NAME` or `hf:FOLDER` reads a Hugging Face GPT-NeoX model through hf.py instead."""
    if str(path).startswith("hf:"):
        from hf import hf_checkpoint  # the bridge's libraries load only when it is used

        return hf_checkpoint(str(path))
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; train one with `python train.py` or pass --ckpt=PATH")
    try:
        # mmap: tensors are read lazily, so looking at a big checkpoint's metadata is cheap
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a truncated or foreign file: say so without a traceback
        raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}); "
                        "is it a train.py checkpoint?") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"{path} is not a headless-lm checkpoint (no model weights); "
                        "pass a train.py checkpoint")
    return ckpt


def checkpoint_model(ckpt: dict, path: str | Path, **config_overrides: Any) -> GPT:
    """The model stored in a loaded checkpoint, with a one-line error for one of other model code."""
    from model import model_from_checkpoint

    try:
        return model_from_checkpoint(ckpt, **config_overrides)
    except (TypeError, RuntimeError) as e:
        raise UserError(f"{path} does not match this model code: {state_dict_problem(e)}") from None


def state_dict_problem(e: Exception) -> str:
    """The first concrete problem in load_state_dict's message (its first line only names the class)."""
    text = str(e)
    if m := re.search(r"size mismatch for ([\w.]+): copying a param with shape torch.Size\((\[.*?\])\) from "
                      r"checkpoint, the shape in current model is torch.Size\((\[.*?\])\)", text):
        return f"tensor {m[1]} has shape {m[2]} in the checkpoint but {m[3]} in the model its config builds"
    for kind, where in (("Missing", "missing from the checkpoint"), ("Unexpected", "not in the model")):
        if m := re.search(rf"{kind} key\(s\) in state_dict: ((?:\"[\w.]+\"(?:, )?)+)", text):
            keys = re.findall(r"\"([\w.]+)\"", m[1])
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            return f"tensor {keys[0]}{more} {where}"
    return first_line(e)
