"""Experiment tracking: --tensorboard and --wandb send every record train.py writes to log.jsonl to TensorBoard
(event files in out_dir/tb/) and to Weights & Biases (a run whose files are in out_dir/wandb/): the training loss,
learning rate, tokens/s (and MFU on a GPU of known peak) every --log_interval steps, and every validation metric.
The step is the x-axis; a scalar's tag is its log.jsonl key under train/ or val/ (train/loss, val/val_ce). Rank 0
alone writes, as for log.jsonl. For train.py, finetune.py and each run of compare.py (their flags pass through).

    python train.py --tensorboard && tensorboard --logdir=out    # --logdir=out-compare: all of compare.py's runs
    python train.py --wandb --wandb_project=headless-lm --wandb_run_name=cwt-tiny
    WANDB_MODE=offline python train.py --wandb                   # later: wandb sync out/wandb/offline-run-*

A resumed run (--resume) continues the same curves: TensorBoard's are purged of the steps after the checkpoint
(as log.jsonl is), and W&B goes on with the same run id. A new run in out_dir (--overwrite, say) starts them over:
the files tracking recorded writing there (out_dir/tracked.jsonl) are removed first, and nothing else; a tracker's
file it did not write (a user's own tb/events.out.tfevents.*) is refused before any work, never deleted. W&B logs
offline when WANDB_MODE=offline or its server cannot be reached (a quick check); `wandb sync` uploads such a run
later.

What each keeps when a run stops: TensorBoard's event file is flushed at every record. W&B's records go through
its own process (wandb-core), which writes the run's .wandb file every WANDB_FLUSH_SECONDS (its default is 15 s:
a run killed then kept none of its history): a run killed outright (SIGKILL, the machine lost) keeps every record
but those of its last fraction of a second. Ctrl-C and SIGTERM stop the loop, which finishes the W&B run: it keeps
every record, as an uninterrupted run does (tests/test_tracking.py kills runs both ways). A run that ends holds
every record in both files when train.py returns (finish_wandb).

Nothing is written outside out_dir: W&B's own logs and caches (WANDB_CACHE_DIR, WANDB_DATA_DIR; by default under
$HOME/.cache) go to out_dir/wandb/cache and out_dir/wandb/data for the run, unless you set those variables (then
they are yours, and W&B writes there). W&B reads your settings and login (WANDB_CONFIG_DIR, ~/.netrc) as always."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import common
import ddp
import doors
import safe_files
from common import UserError, note

WANDB_SERVER = "https://api.wandb.ai"  # or WANDB_BASE_URL: a W&B server of your own
WANDB_FLUSH_SECONDS = 0.2  # how often W&B writes its .wandb file (a killed run loses what came since)
# The folder each tracker writes in, under out_dir, and the names it writes there (what another tracker's run of
# the same kind would write too: a file of these names that no run here recorded writing would mix with the curves)
FOLDERS = {"tensorboard": ("tb", ("events.out.tfevents.*",)),
           "wandb": ("wandb", ("offline-run-*", "run-*", "latest-run", "debug.log", "debug-internal.log",
                               "debug-cli.*.log"))}
WRITTEN = "tracked.jsonl"  # in out_dir: each name tracking created in those folders, relative to out_dir
WANDB_OWN_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_DATA_DIR": "data"}  # under out_dir/wandb unless the user set them


def check_tracking(cfg: Any) -> None:
    """Before any work: a tracking flag whose package is missing is one line naming its pip install; a tracker's
    folder holding a file of its kind that no run here recorded writing is refused (never deleted, never mixed)."""
    for package in FOLDERS:
        if getattr(cfg, package):
            common.need_package(package, f"--{package}")
    mine = set(recorded(Path(cfg.out_dir)))
    for package, (folder, patterns) in FOLDERS.items():
        theirs = sorted(name for name in entries(Path(cfg.out_dir), folder, patterns) if name not in mine)
        if getattr(cfg, package) and theirs:
            raise UserError(f"{Path(cfg.out_dir) / theirs[0]} is a {package} file that no run in --out_dir recorded "
                            f"writing: this run's curves would mix with it; move it away or pick another --out_dir")


def entries(out_dir: Path, folder: str, patterns: tuple[str, ...] = ("*",)) -> set[str]:
    """The names of out_dir/folder matching `patterns`, as paths relative to out_dir; none through a link."""
    path = out_dir / folder
    if path.is_symlink() or not path.is_dir():
        return set()
    return {f"{folder}/{p.name}" for pattern in patterns for p in path.glob(pattern)}


def all_entries(out_dir: Path) -> set[str]:
    return set().union(*(entries(out_dir, folder) for folder, _ in FOLDERS.values()))


def recorded(out_dir: Path) -> list[str]:
    """The names tracking recorded creating in out_dir (WRITTEN), each in tb/ or wandb/, no link followed."""
    path = out_dir / WRITTEN
    if not os.path.lexists(path):
        return []
    fix = f"move {path} away (tracking's list of what it wrote there)"
    rows = common.through_door(lambda: list(doors.jsonl_rows(path, "tracking's list", fix, cut_ok=True)))
    folders = {folder for folder, _ in FOLDERS.values()}
    for number, name in rows:
        parts = name.split("/") if isinstance(name, str) else []
        if len(parts) != 2 or parts[0] not in folders or parts[1] in ("", ".", ".."):
            raise UserError(f"{path} line {number}: {doors.brief(name)} is not a name in tb/ or wandb/; {fix}")
    return [name for _, name in rows]


def record(out_dir: Path, names: set[str]) -> None:
    """Add what tracking created to out_dir's WRITTEN list (before it writes any record there)."""
    if not names:
        return
    try:
        with open(out_dir / WRITTEN, "a", opener=safe_files.no_link) as f:
            f.writelines(json.dumps(name) + "\n" for name in sorted(names))
    except OSError as e:
        raise UserError(f"cannot append to {out_dir / WRITTEN} ({e.strerror}); free some space or fix the "
                        "folder") from None


def scalars(record: dict) -> dict[str, float]:
    """A log.jsonl record's numbers by tag, val/KEY or train/KEY; not the step (the x-axis), nor a null (not finite)."""
    group = "val" if any(key.startswith("val_") for key in record) else "train"
    return {f"{group}/{key}": float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class Tracker:
    """While a training run's loop runs (train.train enters it): every record Run.log writes goes to TensorBoard
    and/or W&B too. On rank 0 only; the others do nothing."""

    def __init__(self, run: Any):
        self.run = run
        self.writer = None  # a torch.utils.tensorboard SummaryWriter
        self.wandb_run = None
        self.environment = contextlib.ExitStack()  # the variables set for W&B while the run is tracked

    def __enter__(self) -> Tracker:
        if not ddp.is_main_process():
            return self
        cfg, out_dir, resumed = self.run.cfg, self.run.out_dir, self.run.resumed_step
        if resumed is None:  # a new run in out_dir: earlier curves would mix with its own
            remove_tracking_files(out_dir)
        self.before = all_entries(out_dir)
        try:
            if cfg.tensorboard:
                self.writer = tensorboard_writer(out_dir, resumed)
            if cfg.wandb:
                self.environment.enter_context(common.environment(wandb_folders(out_dir)))
                self.wandb_run = start_wandb(cfg, out_dir, resumed)
            record(out_dir, all_entries(out_dir) - self.before)
        except BaseException:
            self.close(failed=True)
            raise
        self.run.tracker = self
        return self

    def log(self, record: dict) -> None:
        values = scalars(record)
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, record["step"])
            self.writer.flush()  # on disk now: a run killed later keeps its curves up to here
        if self.wandb_run:
            self.wandb_run.log(values, step=record["step"])

    def __exit__(self, kind, value, traceback) -> None:
        self.run.tracker = None
        self.close(failed=kind is not None)

    def close(self, failed: bool) -> None:
        if self.writer:
            self.writer.close()
        if self.wandb_run:
            finish_wandb(self.wandb_run, failed)
        self.environment.close()
        out_dir = self.run.out_dir
        with contextlib.suppress(UserError):  # what the trackers created since the start (W&B's later logs)
            record(out_dir, all_entries(out_dir) - self.before - set(recorded(out_dir)))


def tensorboard_writer(out_dir: Path, resumed: int | None):
    """Event files in out_dir/tb. Resumed at step s, the steps after s are purged: TensorBoard (and its
    EventAccumulator) drops the earlier files' events from step s + 1 on, so the curves go on with no repeat."""
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
    try:
        return SummaryWriter(log_dir=str(out_dir / "tb"), purge_step=None if resumed is None else resumed + 1)
    except OSError as e:
        raise UserError(f"--tensorboard cannot write {out_dir / 'tb'} ({e.strerror}); fix the folder") from None


def start_wandb(cfg: Any, out_dir: Path, resumed: int | None):
    """A W&B run with its files under out_dir; a resumed run continues the one it logged to before."""
    import wandb
    mode = None  # WANDB_MODE's, when set (offline, disabled, online)
    if not os.environ.get("WANDB_MODE") and not common.reachable(os.environ.get("WANDB_BASE_URL", WANDB_SERVER)):
        mode = "offline"
        note(f"note: the W&B server cannot be reached: --wandb logs offline into {out_dir / 'wandb'}; upload it "
             "later with `wandb sync`")
    run_id = earlier_wandb_id(out_dir) if resumed is not None else None
    try:
        return wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or cfg.out_dir, dir=str(out_dir),
                          config=dataclasses.asdict(cfg), mode=mode, id=run_id, resume="allow" if run_id else None,
                          reinit="create_new", settings=wandb_settings(wandb))
    except Exception as e:  # not logged in, a refused key or project...: wandb's own words, in one line
        raise UserError(f"--wandb could not start a W&B run ({common.first_line(e)}); log in with `wandb login`, "
                        "or log offline with WANDB_MODE=offline") from None


def wandb_folders(out_dir: Path) -> dict[str, str]:
    """W&B's own folders (its logs and caches) under out_dir/wandb, as the variables to set for the run, but those the
    user set (theirs). Set before W&B's process starts: it reads them once, at its start."""
    return {name: str(out_dir / "wandb" / folder) for name, folder in WANDB_OWN_DIRS.items() if name not in os.environ}


def finish_wandb(run: Any, failed: bool) -> None:
    """Finish the W&B run, all of it on disk on return. finish() returns once W&B's process has every record, but
    that process writes the .wandb file later (every WANDB_FLUSH_SECONDS, and whole when it closes the run): read
    at once on a busy machine, the file lacked the last records. Stopping the process (wandb.teardown) waits until
    it has written and closed everything; it is left running while another run of this process (a notebook's own)
    uses it, which then writes this run's last records within WANDB_FLUSH_SECONDS."""
    import wandb
    run.finish(exit_code=1 if failed else 0)
    if wandb.setup().most_recent_active_run is None:
        wandb.teardown()


def wandb_settings(wandb: Any):
    """The .wandb file written every WANDB_FLUSH_SECONDS, where this wandb can be told so (0.2x's Settings forbid
    unknown fields; one without the setting writes when its buffer fills and when the run finishes)."""
    if "x_transaction_log_flush_interval" not in getattr(wandb.Settings, "model_fields", {}):
        return None
    return wandb.Settings(x_transaction_log_flush_interval=WANDB_FLUSH_SECONDS)


def earlier_wandb_id(out_dir: Path) -> str | None:
    """The id of the last W&B run in out_dir/wandb, as W&B names the record log in its folder: run-ID.wandb. The
    folders, {offline-,}run-DATE_TIME-ID, end in -N for the N-th other run of that id started within that second
    (the folder's last field is not the id)."""
    logs = [p for p in (out_dir / "wandb").glob("*run-*-*/run-*.wandb") if not p.parent.is_symlink()]
    return wandb_run_id(max(logs, key=wandb_started)) if logs else None


def wandb_run_id(record_log: Path) -> str:
    return record_log.name.removeprefix("run-").removesuffix(".wandb")


def wandb_started(record_log: Path) -> tuple[str, int]:
    """When a W&B run started, by its folder's name: DATE_TIME, then N."""
    time, _, rest = record_log.parent.name.removeprefix("offline-").removeprefix("run-").partition("-")
    n = rest.removeprefix(wandb_run_id(record_log)).removeprefix("-")
    return time, int(n) if n.isdigit() else 0


def remove_tracking_files(out_dir: Path) -> None:
    """What tracking recorded writing in out_dir (TensorBoard's event files, W&B's run folders and logs: WRITTEN),
    the list itself, and the folders they were in once empty; nothing else, and never through a link."""
    for name in recorded(out_dir):
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
    with contextlib.suppress(FileNotFoundError):
        (out_dir / WRITTEN).unlink()
    for folder, _ in FOLDERS.values():
        with contextlib.suppress(OSError):  # something else is in it: kept
            (out_dir / folder).rmdir()
