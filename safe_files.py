"""Files written safely: whole or not at all, under temp names no user would choose (so only ours are swept),
created new (O_EXCL), never through a symbolic link (O_NOFOLLOW) nor waiting on a pipe (O_NONBLOCK); folders
swapped in whole; one owner of a folder at a time (hold_lock). Plumbing a learner may skip."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from common import UserError

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
    """Delete our temp files and folders whose writer is dead (a kill -9 mid-save), nobody else's; links unfollowed."""
    for tmp in Path(folder).glob(f".*{TEMP_MARK}*.tmp"):
        pid = tmp.name.rsplit(TEMP_MARK, 1)[1].removesuffix(".tmp").split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def hold_lock(folder: str | Path, what: str, name: str = ".lock") -> Iterator[None]:
    """The one owner of a run folder or a dataset, for the block's life: an exclusive flock on the lock file folder/name
    (a run's .lock inside its folder; a dataset's .NAME.lock beside it, as its folder is swapped whole). A second holder
    is refused in one line naming the first. The kernel drops a dead process's lock (a crash leaves no stale lock). The
    file is never unlinked but with the folders this command made, left empty (a refused command leaves no folder),
    while it is held; a lock is ours only once the file we locked is still the one at its name, so nobody holds a lock
    file that was removed. A link, a folder or a special file planted at its name is refused, never written through."""
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
            raise lock_error(e, lock) from None
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
            raise lock_error(e, lock) from None
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


def lock_error(e: OSError, lock: Path) -> UserError:
    """Why the lock file `lock` cannot be made or written, and the fix: nothing else was written (write_error's
    "the partial file was removed" would be false). A file where a folder should be (`--data_root=FILE`) is named."""
    if blocker := next((p for p in reversed(lock.parents) if p.exists() and not p.is_dir()), None):
        return UserError(f"{blocker} is a file, not a folder, so it cannot hold {lock}; pass a folder")
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    fix = "free some space" if full else f"make {lock.parent} writable or pass another folder"
    return UserError(f"cannot take the lock {lock} ({e.strerror}); {fix}")


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
