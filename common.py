"""Run-time plumbing every script shares: flags and config files, one-line user errors, device and dtype,
atomic writes, and checkpoints (save, and load with every format check in one place).

model.py, loss.py and data.py do the work; this file only connects them to a command line and a disk.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import re
import sys
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
        raise UserError(f"config file {path} not found; pass --config=PATH to an existing .json or .toml file")
    if p.suffix not in (".json", ".toml"):
        raise UserError(f"config file {path} must end in .json or .toml")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else tomllib.loads(p.read_text())
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"config file {path} is not valid {p.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a table of key = value settings")
    return data


def flags_help(cls: type, defaults: dict[str, Any] | None = None) -> str:
    """The running script's docstring, then every setting with its type and default."""
    hints, defaults = typing.get_type_hints(cls), defaults or {}
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
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
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


def parse_flags(cls: type, argv: list[str]) -> Any:
    """Build dataclass `cls` from `--key=value` flags and an optional `--config=file.json|toml`
    (precedence: dataclass defaults < config file < command-line flags)."""
    return build_config(cls, read_flags(cls, argv))


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


# Dense bf16 peak FLOP/s, for MFU. Add your GPU here if it is missing.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}


def peak_flops(device: torch.device) -> float | None:
    return peak_flops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_flops_of(gpu_name: str) -> float | None:
    """Match whole words of the name ("NVIDIA H100 80GB HBM3"): an L40S is not an L4."""
    return next((v for k, v in PEAK_FLOPS.items() if re.search(rf"\b{re.escape(k)}\b", gpu_name)), None)


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


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


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """A file to write `path` through: a temp file, fsync'd and renamed to `path` when the block ends
    without error, deleted when it fails. Readers never see a half-written file, and the temp name
    carries the process id, so two writers never share one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name says the file is complete
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)


def write_json(path: str | Path, obj: Any) -> None:
    """A results file (--json=PATH), written atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, default=str) + "\n")
    print(f"results written to {path}", file=sys.stderr)


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
    with atomic_file(path) as f:
        torch.save(payload, f)


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint dict (tensors on CPU, read lazily), with a one-line error for a missing or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; train one with `python train.py` or pass --ckpt=PATH")
    try:
        # mmap: tensors are read lazily, so looking at a big checkpoint's metadata is cheap
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a truncated or foreign file: say so without a traceback
        raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}); is it a train.py checkpoint?") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"{path} is not a headless-lm checkpoint (no model weights); pass a train.py checkpoint")
    return ckpt


def checkpoint_model(ckpt: dict, path: str | Path, **config_overrides: Any) -> GPT:
    """The model stored in a loaded checkpoint, with a one-line error for one of other model code."""
    from model import model_from_checkpoint

    try:
        return model_from_checkpoint(ckpt, **config_overrides)
    except (TypeError, RuntimeError) as e:
        raise UserError(f"{path} does not match this model code: {first_line(e)}") from None
