"""Settings: a dataclass from its defaults < a --config=FILE.json|toml < --key=value flags, each value of its
field's type and within its declared range (doors.field_rules), --help and docs/training.md's table from
the same fields; settings given or idle, bounds that depend on other settings. Plumbing a learner may skip."""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import sys
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import common
import doors
from common import UserError


def parse_flags(cls: type, argv: list[str], quick: dict[str, Any] | None = None) -> Any:
    """Dataclass `cls` from --key=value flags (a bare --flag is true) over a --config file (settings)."""
    return parse_given(cls, argv, quick)[0]


def parse_given(cls: type, argv: list[str], quick: dict[str, Any] | None = None) -> tuple[Any, frozenset[str]]:
    """parse_flags, and the names of the settings the user gave (flags or --config): what a script takes from
    elsewhere when not given (a resumed run's own) and what it may refuse as idle."""
    return common.through_door(settings, cls, argv, quick)


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


def in_range(cfg: Any, name: str, low: float = -math.inf, high: float = math.inf, ends: str = "[]") -> None:
    """Refuse cfg.<name> (each item of a list; None is unset) if it is not finite or lies outside low..high;
    `ends` says whether each end is included: "[]", "[)", "(]" or "()". For a bound that depends on other settings
    or files (min_lr <= lr, a checkpoint's context); a field declares its own range instead (within_ranges)."""
    if why := bound_problem(getattr(cfg, name), low, high, ends):
        raise UserError(f"--{name} {why}")


def within_ranges(cfg: Any) -> None:
    """Refuse the first setting of `cfg` outside its field's declared range (doors.field_rules): the flags' door
    checks them as they are given; this checks settings built in code the same way."""
    if why := settings_problem(cfg):
        raise UserError(why)


def config_path(argv: list[str]) -> str | None:
    """The --config file of a command line (the last one given, as the settings door reads it)."""
    return next((a.partition("=")[2] for a in reversed(argv) if a.startswith("--config=")), None)


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

def config_file(path: str | Path) -> dict[str, Any]:
    """A --config file: a table of settings in JSON or TOML, read as plain data (never executed)."""
    fix = "pass --config=PATH to a .json or .toml file of settings"
    kind = {".json": "JSON", ".toml": "TOML"}.get(Path(path).suffix)
    if kind is None:
        raise doors.Refused(f"config file {path} is not .json or .toml; {fix}")
    data = doors.read_small(path, doors.MAX_TEXT_BYTES, "config file", fix)
    values = doors.parse(data, f"config file {path}", fix, kind)
    if not isinstance(values, dict):
        raise doors.Refused(f"config file {path} must hold a table of key = value settings")
    return values


UNSET = (None, "", "none", "None", "null")  # what an optional field takes as null when no other member takes it


def coerce(key: str, raw: Any, kind: Any, where: str = "") -> Any:
    """A flag or config value as the field's type, or a refusal saying what is expected, naming the value where the
    user gave it (`where`: "--key", the default, or "config file PATH: key"). A union takes the value as its first
    member that can (`--qk_norm=none` is the Literal's "none" where it has one), else as null."""
    said = f"{where or '--' + key}={doors.brief(raw, 200)}"
    args = typing.get_args(kind)
    if typing.get_origin(kind) is Literal:
        if raw not in args:
            raise doors.Refused(f"{said} is not valid; choose one of: {', '.join(map(str, args))}")
        return raw
    if typing.get_origin(kind) is list:  # comma-separated on the command line, a list in a config file
        return [coerce(key, item, args[0], where) for item in (raw if isinstance(raw, list) else str(raw).split(","))]
    if args:  # X | None, or bool | Literal["auto"]: the first member that takes the value
        for member in [a for a in args if a is not type(None)]:
            with contextlib.suppress(doors.Refused):
                return coerce(key, raw, member, where)
        if type(None) in args and raw in UNSET:
            return None
        if len(args) == 2 and type(None) in args:
            return coerce(key, raw, args[0], where)  # its own message
        choices = ["true", "false"] + [str(c) for a in args if typing.get_origin(a) is Literal for c in a.__args__]
        raise doors.Refused(f"{said} is not valid; choose one of: {', '.join(choices)}")
    if kind is bool and str(raw).lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return str(raw).lower() in ("1", "true", "yes", "on")
    try:
        value = kind(float(raw)) if kind is int and "e" in str(raw).lower() else kind(raw)
        if kind is bool or isinstance(raw, (bool, list, dict)) or (kind is int and float(raw) != value):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise doors.Refused(f"{said} is not a valid {kind.__name__}") from None
    return value


def settings(cls: type, argv: list[str], quick: dict[str, Any] | None = None) -> tuple[Any, frozenset[str]]:
    """Dataclass `cls` from --key=value flags (a bare --flag is true) over a --config file, each value of its field's
    type and within its range; and the names of the settings given (on the command line or in the file: not --quick's,
    not the defaults). A refusal names the value as the user gave it: --key, or the file and its key. --help lists the
    settings. A field with metadata repeatable (generate's --prompt) takes every occurrence of its flag."""
    hints = typing.get_type_hints(cls)
    if "--help" in argv or "-h" in argv:
        print_help(cls, hints)
        sys.exit(0)
    repeat = {f.name for f in dataclasses.fields(cls) if f.metadata.get("repeatable")}
    values: dict[str, Any] = {}
    for arg in argv:
        if not arg.startswith("--"):
            raise doors.Refused(f"unexpected argument {arg!r}; settings are given as --key=value")
        key, sep, raw = arg[2:].partition("=")
        key = key.replace("-", "_")
        values[key] = [*values.get(key, []), raw] if key in repeat else raw if sep else "true"
    where = {key: f"--{key}" for key in values}
    if "config" in values:
        path = values.pop("config")
        in_file = config_file(path)
        where = {**{key: f"config file {path}: {key}" for key in in_file}, **where}
        values = {**in_file, **values}
    for key in values:
        if key not in hints:
            dash = "--" if where[key].startswith("--") else ""  # a flag, or a config file's "PATH: key"
            close = difflib.get_close_matches(key, hints, n=1)
            raise doors.Refused(f"{'' if dash else where[key].removesuffix(key)}unknown setting {dash}{key}; "
                          f"{f'did you mean {dash}{close[0]}? ' if close else ''}valid settings: {', '.join(hints)}")
    given = frozenset(values)
    if quick and coerce("quick", values.get("quick", False), bool, where.get("quick", "")):  # fills defaults only
        values = {**quick, **values}
    cfg = cls(**{k: coerce(k, [v] if k in repeat and isinstance(v, str) else v, hints[k], where.get(k, ""))
                 for k, v in values.items()})
    if why := settings_problem(cfg, where):
        raise doors.Refused(why)
    return cfg, given


def settings_problem(cfg: Any, where: dict[str, str] | None = None) -> str | None:
    """The first setting of `cfg` outside its field's declared range, named as the user gave it (`where`: --key, or
    "config file PATH: key"; --key where not told)."""
    for name, (_, *bounds) in doors.field_rules(type(cfg)).items():
        if bounds and (why := bound_problem(getattr(cfg, name), *bounds)):
            return f"{(where or {}).get(name, '--' + name)} {why}"
    return None


def bound_problem(value: Any, low: float = -math.inf, high: float = math.inf, ends: str = "[]") -> str | None:
    """Why a number (each of a list; None is unset) is not finite or lies outside low..high, `ends` saying whether
    each end is included ("[]", "[)", "(]" or "()"), as a flag's message says it ("must be in [1, 8], got 9")."""
    for v in [x for x in (value if isinstance(value, list) else [value]) if x is not None]:
        if not math.isfinite(v):
            return f"must be a finite number, got {v}"
        if v < low or v > high or (v == low and ends[0] == "(") or (v == high and ends[1] == ")"):
            return f"must be {shown_range(low, high, ends)}, got {v}"
    return None


def shown_range(low: float, high: float, ends: str = "[]") -> str:
    """A declared range as --help and the refusals show it, each end exactly as declared: "in [1, 4294967296]",
    "in (0, 1]", an open-ended one "> 0" or ">= 0"."""
    if high == math.inf:
        return f"{'>' if ends[0] == '(' else '>='} {doors.shown_number(low)}"
    return f"in {ends[0]}{doors.shown_number(low)}, {doors.shown_number(high)}{ends[1]}"


def print_help(cls: type, hints: dict[str, Any]) -> None:
    """The script's docstring, then its settings by declaring dataclass (setting_groups): type, default, range, help."""
    print((sys.modules["__main__"].__doc__ or "").strip())
    for title, fields in setting_groups(cls):
        print(f"\n{title}:")
        for f in fields:
            meta = doors.field_meta(cls, f.name)
            shown = f", {shown_range(*meta['range'])}" if "range" in meta else ""
            print(f"  --{f.name:<18} {shown_type(hints[f.name]):<44} default: {default_of(f)!r}{shown}")
            print(f"      {meta.get('help', '(no meaning declared)')}")


def setting_groups(cls: type) -> list[tuple[str, list[dataclasses.Field]]]:
    """Dataclass `cls`'s fields by the class that declares them, its own first, each group under its title: "settings
    (--key=value)" for its own, else the first line of the declaring class's docstring."""
    groups: dict[type, list[dataclasses.Field]] = {}
    for f in dataclasses.fields(cls):
        owner = next(c for c in cls.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
        groups.setdefault(owner, []).append(f)
    return [("settings (--key=value)" if owner is cls else (owner.__doc__ or owner.__name__).split("\n")[0].rstrip("."),
             fields) for owner, fields in sorted(groups.items(), key=lambda group: group[0] is not cls)]


def default_of(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def settings_table(cls: type) -> str:
    """Dataclass `cls`'s settings as a Markdown table (docs/training.md's, tested equal to it): a row per flag, in
    --help's groups and order, with its default, range and meaning, each from its field."""
    rows = ["| flag | default | range | meaning |", "|---|---|---|---|"]
    for title, fields in setting_groups(cls):
        rows.append(f"| **{title}** | | | |")
        for f in fields:
            meta = doors.field_meta(cls, f.name)
            bounds = shown_range(*meta["range"]) if "range" in meta else ""
            meaning = meta.get("help", "").replace("|", "\\|")  # a cell's own bar
            rows.append(f"| `--{f.name}` | {shown_default(default_of(f))} | {bounds} | {meaning} |")
    return "\n".join(rows).replace("|  |", "| |")


def shown_default(value: Any) -> str:
    """A default as a table cell: none, true, false, empty, `text`, a number, a comma-separated list."""
    if isinstance(value, list):
        return ",".join(map(shown_default, value)) or "empty"
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, str):
        return f"`{value}`" if value else "empty"
    return doors.shown_number(value)


def shown_type(hint: Any) -> str:
    """A field's type as --help shows it: int, cosine|constant, int | None, str,str,..."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "|".join(map(str, args))
    if typing.get_origin(hint) is list:
        return f"{shown_type(args[0])},..."
    if args:
        return " | ".join(shown_type(a) for a in args)
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))
