"""requirements.lock: an exact pin for every requirement of the requirements files, within their ranges, so that
the README's test command and CI install what the requirements mean (a forgotten refresh fails here)."""
from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("requirements.txt", "requirements-dev.txt", "requirements-cpu.txt")  # what the lock is compiled from


def requirement_lines(path: Path) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines() if line.split("#", 1)[0].strip()]


def test_the_lock_pins_every_requirement_within_its_range_and_names_its_refresh_command():
    text = (ROOT / "requirements.lock").read_text()
    command = next(line.strip("# ") for line in text.splitlines()[:3] if "uv pip compile" in line)
    assert all(source in command.split() for source in SOURCES) and "-o requirements.lock" in command
    pins = {}
    for line in requirement_lines(ROOT / "requirements.lock"):
        assert re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", line), line  # name==version, nothing looser
        name, version = line.split("==")
        pins[canonicalize_name(name)] = version
    for source in SOURCES:
        for line in requirement_lines(ROOT / source):
            wanted = Requirement(line)
            name = canonicalize_name(wanted.name)
            assert name in pins, f"{source}: {wanted} is not in requirements.lock: refresh it ({command})"
            assert wanted.specifier.contains(pins[name], prereleases=True), (source, str(wanted), pins[name])
    assert pins["torch"].endswith("+cpu")  # the tests' torch: the CPU build
