"""A training run's folder: its own while it runs (claimed, locked), its checkpoint and log (rank 0 alone
writes), its compiler cache. The checkpoint itself: checkpoint.py. Plumbing a learner may skip."""
from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import cli
import common
import ddp
import doors
import safe_files
from common import UserError


def run_files(out_dir: str | Path) -> list[Path]:
    """What a training run writes in its out_dir (besides its .lock and temp files)."""
    return [Path(out_dir) / "ckpt.safetensors", Path(out_dir) / "log.jsonl"]


def resumes(out_dir: str | Path, resume: bool | str) -> bool:
    """Whether a run with this --resume continues out_dir's checkpoint (auto: if there is one)."""
    return resume is True or (resume == "auto" and run_files(out_dir)[0].is_file())


def check_out_dir(out_dir: Path) -> None:
    """What an out_dir must be before a command reads anything in it (its plan reads the run's checkpoint) or claims
    it: a folder, not held by a live run (named at once: --resume and --overwrite cannot take its files), its run
    files plain files."""
    if any(p.exists() and not p.is_dir() for p in (out_dir, *out_dir.parents)):
        raise UserError(f"--out_dir={out_dir}: it or a folder above it is a file; pass a folder")
    if holder := safe_files.lock_holder(out_dir):
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
    if not ddp.launched_as_rank_0():
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
    with safe_files.hold_lock(out_dir, "training run"):
        safe_files.remove_stale_temps(out_dir)
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
    folder = safe_files.temp_path(out_dir / "torch-cache")
    try:
        with common.environment({"TORCHINDUCTOR_CACHE_DIR": str(folder.absolute())}):
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
        common.through_door(doors.run_log, log, True)


def new_run_id() -> str:
    """A run's id, in its checkpoint and in every record of its log: the two files of one run carry the same."""
    return secrets.token_hex(8)


def start_log(out_dir: Path, resumed_step: int | None, run_id: str | None = None) -> None:
    """The log of a claimed run, once it is built. A new run removes the earlier run's pair, its checkpoint
    first, before its own first log line (a kill between leaves a log alone, which --resume=auto replaces):
    never one run's checkpoint beside another's log. A resumed one keeps its records up to its checkpoint's step
    (a line cut short by a crash dropped; any other damage refused by its door), once they are found to be of
    the checkpoint's run (`run_id`, None for runs from before ids)."""
    if not ddp.is_main_process():
        return
    ckpt, log = run_files(out_dir)
    if resumed_step is None:
        ckpt.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
    elif log.is_file():
        records = common.through_door(doors.run_log, log, True)
        other = next((r.get("run_id") for r in records if r.get("run_id") != run_id), run_id)
        if other != run_id:
            raise UserError(f"{log} is the log of another run (run_id {cli.brief_value(other)}) than {ckpt} (run_id "
                            f"{cli.brief_value(run_id)}): they do not belong together; start over with --overwrite, or "
                            "move one of them away")
        with safe_files.atomic_file(log, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records if r["step"] <= resumed_step)


def append_log(out_dir: Path, record: dict) -> None:
    record = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
    try:  # valid JSON always: a null, never NaN or Infinity
        with open(out_dir / "log.jsonl", "a", opener=safe_files.no_link) as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        raise UserError(f"cannot append to {out_dir / 'log.jsonl'} ({e.strerror}); free some space or fix the "
                        "folder, then continue with --resume") from None
