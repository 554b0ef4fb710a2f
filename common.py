"""Run-time plumbing every script shares: settings, one-line errors, device and dtype, processes under
torchrun, safe writes, and checkpoints. model.py, loss.py and data.py do the work; files are read through
their doors (doors.py)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Literal

import torch

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "bfloat16", "float16", "float32"]


class UserError(Exception):
    """A mistake the user can fix: scripts print its one-line message, no traceback, and exit 2."""


class Interrupted(BaseException):
    """Raised by a script's main once a signal's stop has been saved, or by SIGTERM outside a training loop: it
    exits 128 + the signal's number. Like KeyboardInterrupt, it passes through `except Exception`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_main(main: Callable[[list[str]], Any]) -> None:
    """Run a script's main(argv): a user mistake is one line on stderr and exit code 2; a stop by Ctrl-C
    or SIGTERM (saved first where there is something to save) exits 130 or 143, as a shell expects; SIGTERM
    unwinds as Ctrl-C does, so that what was half-written is removed."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        main(sys.argv[1:])
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except UserError as e:
        print(f"error{f' (rank {rank()})' if world_size() > 1 else ''}: {e}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def through_door(read: Callable[..., Any], *args: Any) -> Any:
    """What a door (doors.py) reads; its refusal, a ValueError for notebooks, as the scripts' UserError."""
    import doors
    try:
        return read(*args)
    except doors.Refused as e:
        raise UserError(str(e)) from None


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]  # a library's error, in a one-line message


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # found without importing it
    if spec is None:
        raise UserError(f"package {name} is not installed; run: pip install -r requirements.txt")
    return Path(next(iter(spec.submodule_search_locations or []), None) or Path(spec.origin).parent)


def need_extra(module: str, flag: str) -> None:
    """A flag whose extra file a fork deleted is one line, before any work."""
    if importlib.util.find_spec(module) is None:
        raise UserError(f"{flag} needs {module}.py, which is not in this checkout; restore it or drop {flag}")


# Settings: a dataclass from its defaults < a --config=FILE.json|toml < --key=value flags, through their door


def parse_flags(cls: type, argv: list[str], quick: dict[str, Any] | None = None) -> Any:
    """Dataclass `cls` from --key=value flags (a bare --flag is true) over a --config file (doors.settings)."""
    import doors
    return through_door(doors.settings, cls, argv, quick)


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


# Device, precision, and processes (torchrun starts one per GPU; without it, this is rank 0 of 1)


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


PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}  # dense bf16 FLOP/s, for MFU


def peak_flops(device: torch.device) -> float | None:
    """A GPU's peak, matched on whole words of its name ("NVIDIA H100 80GB HBM3"): an L40S is not an L4."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_FLOPS.items() if re.search(rf"\b{re.escape(k)}\b", name)), None)


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the matmuls; the losses upcast their scores to fp32 themselves."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


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


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_main_process() -> bool:
    return rank() == 0  # the one process that prints progress and writes logs and checkpoints


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        torch.distributed.all_reduce(values)
    return values


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


# Files: written whole or not at all, under temp names no user would choose (so only ours are swept), created
# new (O_EXCL), never through a symbolic link (O_NOFOLLOW) nor waiting on a pipe (O_NONBLOCK)

TEMP_MARK = ".headless-lm-"


def temp_path(path: Path) -> Path:
    """A temp name beside `path`: the pid (for the stale-temp sweep) and a random part nobody can plant a link at."""
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(8)}.tmp")


def no_link(path: str, flags: int) -> int:
    """open()'s opener for the files we write (a file opened to be written anew is a new one) and the lock's."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_EXCL if flags & os.O_TRUNC else 0), 0o666)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Write `path` through a temp file, fsync'd and renamed when the block succeeds: never half a file."""
    path = Path(path)
    if path.is_dir() or any(p.exists() and not p.is_dir() for p in path.parents):
        raise UserError(f"cannot write {path}: it is a folder, or a folder above it is a file")
    tmp = temp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode, opener=no_link) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # a read-only folder must not hide the first error behind a second
            tmp.unlink(missing_ok=True)
        raise write_error(e, path, "file") from None


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A folder built beside `path`, which replaces it as a unit when the block succeeds and is removed when it
    fails: `path` is the earlier folder, whole, or the new one (a stop between the renames puts it back)."""
    path = Path(path)
    remove_stale_temps(path.parent)
    tmp = temp_path(path)
    old = temp_path(path)
    try:
        tmp.mkdir()
        yield tmp
        if os.path.lexists(path):
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException as e:
        if os.path.lexists(old) and not os.path.lexists(path):
            os.rename(old, path)
        raise write_error(e, path, "folder") from None
    finally:
        for folder in (tmp, old):
            shutil.rmtree(folder, ignore_errors=True)


def write_error(e: BaseException, path: Path, what: str) -> BaseException:
    """A failed write as one line when an OSError caused it (torch.save wraps it in a RuntimeError), else `e`."""
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return e
    kept = f"{path} is unchanged" if path.exists() else f"no {path} was written"
    kept = kept if what == "file" else "any earlier one is unchanged"  # a folder: hold_lock may have made it
    full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "no space left on device" if full else f"cannot write ({cause.strerror})"
    return UserError(f"{why} while saving {path}; the partial {what} was removed and {kept}")


def remove_stale_temps(folder: str | Path) -> None:
    """Delete our temp files and folders whose writer is dead (a kill -9 mid-save), and nobody else's files;
    a link is removed, never followed."""
    for tmp in Path(folder).glob(f".*{TEMP_MARK}*.tmp"):
        pid = tmp.name.rsplit(TEMP_MARK, 1)[1].removesuffix(".tmp").split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def hold_lock(folder: str | Path, what: str) -> Iterator[None]:
    """An exclusive flock on the folder for the block's life; a second holder is refused in one line naming
    the first (folder/.lock, written anew: never through a planted link). The kernel drops a dead process's
    lock: a crash leaves no stale lock. The folders it made are removed if the block leaves them empty."""
    folder = Path(folder)
    info = folder / ".lock"
    made = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
    except OSError as e:
        raise UserError(f"cannot create {folder} ({e.strerror}); pass a folder you can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = "another process"
        with contextlib.suppress(OSError), open(info, "rb", opener=no_link) as f:  # a line; no link, no pipe
            holder = f.read(200).decode(errors="replace").strip() or holder
        raise UserError(f"{folder} is in use by another {what} ({holder}); wait for it to finish or use another "
                        "folder") from None
    try:
        with atomic_file(info, "w") as f:  # anew: a link planted as .lock is replaced, never written through
            f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
        yield
    finally:
        with contextlib.suppress(OSError):
            info.unlink(missing_ok=True)  # before the lock goes: the next holder's file is never removed
        os.close(fd)
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()


# A training run's folder: its own while it runs, its log, and Ctrl-C or SIGTERM (rank 0 alone writes)


@contextlib.contextmanager
def claim_out_dir(out_dir: Path, resumed_step: int | None, overwrite: bool, auto: bool) -> Iterator[None]:
    """out_dir for this run alone. A new run never replaces another's checkpoint or log (but with --overwrite,
    or a log without a checkpoint with --resume=auto); a resumed one keeps the log up to its checkpoint."""
    if not is_main_process():
        yield
        return
    log = out_dir / "log.jsonl"
    ckpt = out_dir / "ckpt.pt"
    if any(p.exists() and not p.is_dir() for p in (out_dir, *out_dir.parents)):
        raise UserError(f"--out_dir={out_dir}: it or a folder above it is a file; pass a folder")
    if log.is_symlink() or log.is_dir():
        raise UserError(f"{log} is a folder or a link, not a run's log; move it away or pick another --out_dir")
    if resumed_step is None and not overwrite and (ckpt.exists() or (log.exists() and not auto)):
        raise UserError(f"{out_dir} holds another run ({'ckpt.pt' if ckpt.exists() else 'log.jsonl'}); continue "
                        "it with --resume, start over with --overwrite, or pick another --out_dir")
    with hold_lock(out_dir, "training run"):
        remove_stale_temps(out_dir)
        if resumed_step is not None and log.is_file():  # a line cut short by a crash does not end in "}"
            kept = [line + "\n" for line in log.read_text().splitlines()
                    if line.endswith("}") and json.loads(line).get("step", 0) <= resumed_step]
            with atomic_file(log, "w") as f:
                f.writelines(kept)
        elif resumed_step is None:
            log.unlink(missing_ok=True)
        yield


def append_log(out_dir: Path, record: dict) -> None:
    record = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
    try:  # valid JSON always: a null, never NaN or Infinity
        with open(out_dir / "log.jsonl", "a", opener=no_link) as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        raise UserError(f"cannot append to {out_dir / 'log.jsonl'} ({e.strerror}); free some space or fix the "
                        "folder, then continue with --resume") from None


def note(message: str) -> None:
    if is_main_process():  # a status line on stderr, once
        print(message, file=sys.stderr)


class StopFlag:
    """Ctrl-C or SIGTERM: the loop stops at the next agreed step, saves and exits. A second one stops at
    once, but never in the middle of a save: it waits for the save to end."""

    def __enter__(self):
        self.requested = False
        self.saving = False
        self.pending = False
        self.signal = None  # the first signal's number
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        if self.requested and not self.saving:
            raise KeyboardInterrupt
        self.pending = self.requested  # a second one during a save: once it is done
        self.requested = True
        if not self.pending:
            self.signal = signum
            note(f"\n{signal.Signals(signum).name} received: saving a checkpoint")

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.saving = True
        try:
            yield
        finally:
            self.saving = False
        if self.pending:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# Checkpoints: plain data and tensors, read back with weights_only=True (never unpickled code)


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Write atomically; refused, the previous file untouched, when a weight or a metric is not finite."""
    values = {"the training loss": payload.get("loss"), **(payload.get("val") or {})}
    weights = (f"weight {k} is not finite" for k, t in payload["model"].items()
               if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    metrics = (f"{k} is {v}" for k, v in values.items() if v is not None and not math.isfinite(v))
    problem = next(weights, None) or next(metrics, None)
    if problem:
        raise UserError(f"not saving {path}: {problem} at step {payload.get('step', '?')}; "
                        f"{last_good_checkpoint(path)}. Lower --lr or raise --warmup_iters")
    try:
        with atomic_file(path) as f:
            torch.save(payload, f)
    except UserError as e:  # no space left
        raise UserError(f"{e}; {last_good_checkpoint(path)}. Free some space, then continue with --resume"
                        ) from None


def diverged(what: str, value: float, step: int, ckpt: Path) -> UserError:
    """The error that stops a run whose loss or metric is no longer finite, before it saves anything."""
    return UserError(f"{what} became {value} at step {step}; stopped without saving ({last_good_checkpoint(ckpt)}): "
                     "lower --lr or raise --warmup_iters")


def last_good_checkpoint(path: str | Path) -> str:
    try:  # what a user can continue from after a refused or failed save: a checkpoint its doors accept whole
        import doors
        from model import GPTConfig
        ckpt = doors.checkpoint(path, GPTConfig)
        doors.resumable(path, ckpt)
        return f"the last good checkpoint is {path} (step {ckpt['step']})"
    except Exception:  # none yet, unreadable, or damaged
        return "there is no earlier checkpoint"


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint dict through its door (doors.checkpoint: the zip's directory, then every field, before
    anything is built; tensors read lazily); hf:ORG/NAME or hf:FOLDER: a GPT-NeoX model, through hf.py."""
    if str(path).startswith("hf:"):
        need_extra("hf", "an hf: source")
        from hf import hf_checkpoint
        return hf_checkpoint(str(path))
    import doors
    from model import GPTConfig
    return through_door(doors.checkpoint, path, GPTConfig)


def checkpoint_model(ckpt: dict, path: str | Path, **overrides: Any):
    """The model of a loaded checkpoint, its weights checked against its config first (model.from_checkpoint)."""
    from model import from_checkpoint
    try:
        return from_checkpoint(ckpt, **overrides)
    except (TypeError, ValueError) as e:
        raise UserError(f"{path} does not match this model code: {first_line(e)}") from None
