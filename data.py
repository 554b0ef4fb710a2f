"""Text -> tokens -> memory-mapped shards -> training batches.

Also home to the small command-line helpers every script shares (`UserError`, `run_main`,
`parse_flags`), because this is the bottom layer that all of them already import.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any, Callable, Literal

# ----------------------------------------------------------------------------------------------
# Command-line helpers shared by data.py, train.py, finetune.py, eval.py, generate.py, bench.py


class UserError(Exception):
    """A mistake the user can fix. Scripts print its one-line message (no traceback), exit 2."""


def run_main(main: Callable[[list[str]], Any]) -> None:
    """Run a script's main(argv): user mistakes become one line on stderr and exit code 2."""
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def _coerce(key: str, raw: Any, kind: Any) -> Any:
    """Convert a flag or config value to the dataclass field's type, or explain what is expected."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        if raw not in args:
            raise UserError(f"--{key}={raw!r} is not valid; choose one of: {', '.join(map(str, args))}")
        return raw
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):  # Optional[X]
        if raw in (None, "", "none", "None"):
            return None
        return _coerce(key, raw, next(a for a in args if a is not type(None)))
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("1", "true", "yes", "on"):
            return True
        if str(raw).lower() in ("0", "false", "no", "off"):
            return False
        raise UserError(f"--{key}={raw!r} is not a boolean; use --{key}=true or --{key}=false")
    if kind in (int, float):
        if isinstance(raw, bool):
            raise UserError(f"--{key} expects a number, got {raw!r}")
        try:
            value = kind(float(raw)) if kind is int and "e" in str(raw).lower() else kind(raw)
        except (TypeError, ValueError):
            raise UserError(f"--{key}={raw!r} is not a valid {kind.__name__}") from None
        if kind is int and isinstance(raw, float) and raw != int(raw):
            raise UserError(f"--{key}={raw!r} is not a whole number")
        return value
    if kind is str:
        if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
            raise UserError(f"--{key} expects text, got {raw!r}")
        return str(raw)
    if origin is list:  # comma-separated on the command line, a list in config files
        items = raw if isinstance(raw, list) else [s for s in str(raw).split(",") if s]
        return [_coerce(key, item, args[0]) for item in items]
    raise TypeError(f"unsupported config field type for {key}: {kind}")


def _read_config_file(path: str) -> dict[str, Any]:
    """Load a JSON or TOML config as plain data (never executed)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {path} not found; pass --config=PATH to an existing .json or .toml file")
    try:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
        elif p.suffix == ".toml":
            data = tomllib.loads(p.read_text())
        else:
            raise UserError(f"config file {path} must end in .json or .toml")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"config file {path} is not valid {p.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a table of key = value settings")
    return data


def parse_flags(cls: type, argv: list[str], defaults: dict[str, Any] | None = None) -> Any:
    """Build dataclass `cls` from `--key=value` flags (and an optional `--config=file.json|toml`).

    Precedence: dataclass defaults < `defaults` < config file < command-line flags. A bare `--flag`
    means true. Unknown keys and values of the wrong type or outside a Literal's choices are
    UserErrors that name the valid options.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = dict(defaults or {})
    flags: dict[str, Any] = {}
    for arg in argv:
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}; settings are given as --key=value")
        key, sep, raw = arg[2:].partition("=")
        flags[key.replace("-", "_")] = raw if sep else "true"
    if "config" in flags and "config" not in names:
        values.update(_read_config_file(flags.pop("config")))
    values.update(flags)
    for key, raw in values.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean --{close[0]}? " if close else ""
            raise UserError(f"unknown setting --{key}; {hint}valid settings: {', '.join(names)}")
        values[key] = _coerce(key, raw, hints[key])
    return cls(**values)
