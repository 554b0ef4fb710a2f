"""Results files and plots, and the JSON rows evaluation reads: shared by the scripts that measure (eval.py,
bench.py, compare.py, glue.py, xnli.py)."""
from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import doors
from common import UserError, atomic_file


def jsonl_rows(path: str | Path, what: str, fix: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each row of a .jsonl file this project did not write, through its door
    (doors.jsonl_rows: line by line, within bounds, UTF-8 text and JSON); a refusal as the scripts' one line."""
    try:
        yield from doors.jsonl_rows(path, what, fix)
    except doors.Refused as e:
        raise UserError(str(e)) from None


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
