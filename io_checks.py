"""Inputs and outputs, declared at a command's start (docs/failures.md, contract 1): an output is never an
input, never inside one, never holds one; an existing output is replaced only when it is this project's of
its kind; a path no file system could hold is refused first. Plumbing a learner may skip."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import doors
import safe_files
from common import UserError

NAME_MAX = 255  # bytes of one name in a path (Linux file systems)
PATH_MAX = 4095  # bytes of a whole path
OUTPUT_KINDS = {"results": "results (a JSON table or list) as this project writes them",
                "plot": "a plot (an image) matplotlib wrote", "tokenizer": "a tokenizer.json"}
DEFAULT_KINDS = {"--json": "results", "--plot": "plot"}  # the kind of a flag's output unless told
IMAGES = (b"\x89PNG", b"%PDF", b"<?xml", b"<svg", b"\xff\xd8\xff", b"GIF8", b"%!PS")


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
            if os.path.isfile(path) and (holder := safe_files.lock_holder(Path(path).parent)):  # not an hf: folder
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
