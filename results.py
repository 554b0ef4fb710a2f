"""Results files and plots, and the JSON rows evaluation reads: shared by the scripts that measure (eval.py,
bench.py, compare.py, glue.py, xnli.py). As a script, it draws the curves of training runs:

    python results.py --log=out/log.jsonl,out-ce/log.jsonl --plot=out/curves.png

the training loss and each validation metric against the tokens seen, a panel a metric, a line a run (the log.jsonl
of train.py or finetune.py runs; matplotlib needed, an optional extra). compare.py draws its runs with it too."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import doors
from cli import parse_flags
from common import UserError, run_main, through_door
from io_checks import declare_io
from safe_files import atomic_file


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


def import_pyplot(plot: str | Path = ""):
    """matplotlib is optional (--plot): a one-line error without it; and, given the --plot path, one if matplotlib
    writes no file of its extension (before any work, not after)."""
    try:
        with matplotlib_folder():
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UserError("--plot needs matplotlib, an optional extra: pip install matplotlib") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    if plot and (ext := Path(plot).suffix[1:] or "png") not in formats:
        raise UserError(f"--plot={plot}: matplotlib writes no .{ext} file; name it .png, or one of: "
                        f"{', '.join(sorted(formats))}")
    return plt


@contextlib.contextmanager
def matplotlib_folder() -> Iterator[None]:
    """matplotlib's config folder while it is imported: a temp folder, removed after it. matplotlib writes its font
    list there on import (in ~/.cache/matplotlib by default; built again in a quarter of a second). Where MPLCONFIGDIR
    says where, it is the user's choice."""
    if "MPLCONFIGDIR" in os.environ or "matplotlib" in sys.modules:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="matplotlib-") as folder, common.environment({"MPLCONFIGDIR": folder}):
        yield


def save_figure(fig: Any, path: str | Path) -> None:
    """A figure, laid out tight, as an image file (the format from its extension), written atomically."""
    fig.tight_layout()
    with atomic_file(path) as f:  # a failed write is atomic_file's one line
        fig.savefig(f, format=Path(path).suffix[1:] or "png", dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def save_results(result: Any, json_path: str, plot_path: str, plot: Callable[[Any, str], None]) -> None:
    """The --json and --plot outputs of a measuring script."""
    if json_path:
        write_json(json_path, result)
    if plot_path:
        plot(result, plot_path)


# Training curves: a panel a metric, a line a run (results.py --log, compare.py)

CURVE_TITLES = {"loss": "training loss (each run's own objective)", "val_ce": "validation CE (nats/token)",
                "val_bpb": "validation bits per byte", "val_ppl": "validation perplexity (log scale)",
                "val_cwt": "validation contrastive loss", "val_acc": "validation in-batch top-1 accuracy"}
Curves = dict[str, list[tuple[float, float]]]  # metric: its (x, value) points


def log_curves(records: list[dict], x: Callable[[dict], float] = lambda r: r["tokens"]) -> Curves:
    """A run's log records (doors.run_log) as curves of its loss and validation metrics against x; nulls left out."""
    curves: Curves = {}
    for r in records:
        for key, value in r.items():
            if (key == "loss" or key.startswith("val_")) and isinstance(value, (int, float)):
                curves.setdefault(key, []).append((x(r), value))
    return curves


def plot_curves(runs: dict[str, Curves], path: str | Path, xlabel: str, title: str,
                marks: dict[str, float] | None = None) -> None:
    """One panel per metric (CURVE_TITLES' order, then any other), one line per run (its label: runs' key), and a
    dashed vertical line at each of `marks` (label: x)."""
    plt = import_pyplot()
    known = list(CURVE_TITLES)
    metrics = sorted({m for curves in runs.values() for m in curves},
                     key=lambda m: (known.index(m) if m in known else len(known), m))
    if not metrics:
        raise UserError("nothing to plot: the runs logged no training loss and no validation metric")
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    size = (6.5, 4.2) if len(metrics) == 1 else (4.6 * cols, 3.4 * rows + 0.6)
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for i, (label, curves) in enumerate(runs.items()):
            if points := curves.get(metric):
                ax.plot(*zip(*points), marker="o" if len(points) <= 40 else None, ms=3, lw=1.2, color=f"C{i}",
                        label=label)
        for j, (label, x) in enumerate((marks or {}).items()):
            ax.axvline(x, color="grey", ls=("--", ":", "-.")[j % 3], lw=1, label=label)
        ax.set_title(CURVE_TITLES.get(metric, metric), fontsize=10)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_formatter(plt.FuncFormatter(short_number))
        if metric == "val_ppl":
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.flat[len(metrics):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    save_figure(fig, path)


def short_number(value: float, position: Any = None) -> str:
    """An axis tick as 200k, 1.5M or 3T, never 200000 run into its neighbour."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


@dataclass
class PlotConfig:
    log: list[str] = dataclasses.field(default_factory=list, metadata={
        "help": "log.jsonl files of train.py / finetune.py runs, comma-separated: a line each"})
    plot: str = dataclasses.field(default="", metadata={"help": "the image to write: .png, .pdf or .svg"})


def run_labels(paths: list[str]) -> list[str]:
    """A run's label: its folder (out, out-ce), or the path given when two folders share a name."""
    names = [Path(p).parent.name or str(Path(p).parent) for p in paths]
    return names if len(set(names)) == len(names) else [str(Path(p).parent) for p in paths]


def main(argv: list[str]) -> None:
    cfg = parse_flags(PlotConfig, argv)
    if not cfg.log or not cfg.plot:
        raise UserError("pass --log=out/log.jsonl[,out-ce/log.jsonl,...] and --plot=FILE.png")
    declare_io(reads={"--log": cfg.log}, writes={"--plot": cfg.plot})
    import_pyplot(cfg.plot)  # fail before reading anything
    runs = {label: log_curves(through_door(doors.run_log, path, True))
            for label, path in zip(run_labels(cfg.log), cfg.log)}
    if empty := [label for label, curves in runs.items() if not curves]:
        raise UserError(f"{', '.join(empty)}: the log holds no training loss or validation yet; nothing to draw")
    plot_curves(runs, cfg.plot, "tokens seen", "training curves: " + ", ".join(runs))


if __name__ == "__main__":
    run_main(main)
