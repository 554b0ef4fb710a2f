"""Results files and plots, and the JSON rows evaluation reads: shared by the scripts that measure (eval.py,
bench.py, compare.py, glue.py, xnli.py)."""
from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import doors
from common import UserError, atomic_file

# What an existing output file must be for a command to replace it: this project's output of that kind
OUTPUT_KINDS = {"json": "results (a JSON table or list)", "plot": "a plot (an image)", "out": "a tokenizer.json"}
IMAGES = (b"\x89PNG", b"%PDF", b"<?xml", b"<svg", b"\xff\xd8\xff", b"GIF8", b"%!PS")


def parse_jsonl_line(line: str, where: str) -> Any:
    """One line of a .jsonl file this project did not write: any way it is broken is one line naming `where`."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON ({e.msg} at column {e.colno})") from None
    except ValueError:  # an integer of more than 4300 digits
        raise UserError(f"{where} holds a number too long to read") from None
    except RecursionError:
        raise UserError(f"{where} is JSON nested too deeply to be an example") from None


def check_output_path(path: str | Path, flag: str, inputs: tuple = ()) -> None:
    """Refuse, before any work, an output file that could never be written or must not be replaced: one that
    resolves to an input of the command, a symbolic link, a folder or another thing than a regular file, a
    path below a file or in a folder it cannot write, or an existing file that is not this project's output of
    its kind (OUTPUT_KINDS, by the flag: --json, --plot, bpe.py's --out). An empty file may be replaced."""
    path = Path(path)
    if path.is_symlink():
        raise UserError(f"--{flag}={path} is a symbolic link; pass the path of a file, which is written in its place")
    if path.is_dir():
        raise UserError(f"--{flag}={path} is a directory; pass a file path such as {path / 'results.json'}")
    if any(os.path.realpath(path) == os.path.realpath(source) for source in inputs if source):
        raise UserError(f"--{flag}={path} is also an input of this command; pass another path")
    if any(p.exists() and not p.is_dir() for p in path.parents):
        raise UserError(f"--{flag}={path}: a folder above it is a file")
    parent = next(p for p in path.parents if p.exists())
    if not os.access(parent, os.W_OK):
        raise UserError(f"--{flag}={path}: {parent} is not writable; pass a path you can write")
    if os.path.lexists(path) and not is_output(path, flag):
        raise UserError(f"--{flag}={path} exists and is not {OUTPUT_KINDS[flag]} as this project writes it; it "
                        "is left as it is: move it away or pass another path")


def is_output(path: Path, flag: str) -> bool:
    """Whether an existing file (read through a door: a regular file of a sane size) is one this project's
    output of that kind may replace."""
    try:
        data = doors.read_small(path, doors.MAX_TOKENIZER_BYTES if flag == "out" else doors.MAX_TEXT_BYTES, "", "")
        value = doors.parse(data, "", "") if data and flag != "plot" else None
    except doors.Refused:
        return False
    if flag == "plot" or not data:
        return data.startswith(IMAGES) or not data
    return isinstance(value, (dict, list)) if flag == "json" else isinstance(value, dict) and "model" in value


def check_finite(values: Any, what: str) -> None:
    """Every number a script prints or writes is finite, or it stops in one line naming the first that is not
    (NaN or infinite weights give NaN metrics, and JSON has no NaN)."""
    if isinstance(values, dict):
        for key, value in values.items():
            check_finite(value, f"{what}: {key}")
    elif isinstance(values, (list, tuple)):
        for i, value in enumerate(values):
            check_finite(value, f"{what}[{i}]")
    elif isinstance(values, float) and not math.isfinite(values):
        raise UserError(f"{what} is {values}, not a finite number: the model's weights or scores are not finite "
                        "(a damaged or diverged checkpoint?); nothing was written")


def write_json(path: str | Path, obj: Any) -> None:
    """A results file (--json=PATH), written atomically. When the write fails all the same (a disk that
    filled up or went read-only during the run), the results go to stdout, not lost with the run."""
    check_finite(obj, "the results")
    text = json.dumps(obj, indent=1, default=str) + "\n"
    try:
        with atomic_file(path, "w") as f:
            f.write(text)
    except UserError as e:  # atomic_file's one line: a full disk, a read-only folder...
        sys.stdout.write(text)
        raise UserError(f"{e}; the results were printed on stdout instead") from None
    print(f"results written to {path}", file=sys.stderr)


def import_pyplot():
    """matplotlib is optional (--plot): a one-line error without it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib, an optional extra: pip install matplotlib") from None
    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    """A figure as an image file (the format from its extension), written atomically."""
    with atomic_file(path) as f:  # a failed write is atomic_file's one line
        fig.savefig(f, format=Path(path).suffix[1:] or "png", dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def save_results(result: Any, json_path: str, plot_path: str, plot: Callable[[Any, str], None]) -> None:
    """The --json and --plot outputs of a measuring script."""
    if json_path:
        write_json(json_path, result)
    if plot_path:
        plot(result, plot_path)


def format_metric(value: float | None, digits: int = 4) -> str:
    """Fixed-point, but never hundreds of digits (a perplexity capped at e^700 would print 304); "-" if none."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.{digits}g}"
