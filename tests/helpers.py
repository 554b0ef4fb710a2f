"""Helpers shared by test files. It imports the core only (common, train), so a fork that deletes an extra and
its test files keeps every other test file collecting (tests/test_style.py checks it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import common
from train import TrainConfig


def tiny_config(data_dir, out_dir, **overrides) -> TrainConfig:
    """A 30-step run of the (shrunk) tiny preset on the test dataset, validated every 10 steps, on CPU."""
    settings = dict(dataset=str(data_dir), preset="tiny", block_size=32, batch_size=8, max_iters=30,
                    warmup_iters=5, eval_interval=10, eval_batches=2, log_interval=1, out_dir=str(out_dir),
                    device="cpu", seed=0)
    return TrainConfig(**{**settings, **overrides})


def read_log(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too), by relative path: equal snapshots, nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(main, argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """What `python SCRIPT.py ARGV` does when it fails: (exit code, stdout, the last line of stderr)."""
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        common.run_main(main)
    out, err = capsys.readouterr()
    return e.value.code, out, (err.splitlines() or [""])[-1]
