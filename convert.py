"""A checkpoint of this project from before safetensors (a ckpt.pt that torch.save wrote) converted, once, into the
checkpoint every script reads. A script that is given a ckpt.pt refuses it in one line that names this command, with
full paths, quoted for the shell, to paste from any folder:

    python convert.py --ckpt=out/ckpt.pt --out=out/ckpt.safetensors

A ckpt.pt is a pickle: it is read with torch.load(weights_only=True), which builds tensors and plain values only, yet
convert only a file you trust as your own (no other script reads a pickle). The new checkpoint passes the door every
script reads it through (checkpoint.read_checkpoint) before it takes its name; an existing --out is never replaced.
"""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import doors
import safe_files
from checkpoint import load_checkpoint, save_checkpoint
from cli import config_path, parse_flags
from common import UserError, first_line, run_main, through_door
from io_checks import declare_io
from train import TrainConfig

FIX = "pass a ckpt.pt that train.py or finetune.py wrote before checkpoints were safetensors"


@dataclass
class ConvertConfig:
    ckpt: str = field(default="", metadata={"help": "the checkpoint torch.save wrote (ckpt.pt)"})
    out: str = field(default="", metadata={"help": "the safetensors checkpoint to write; it must not exist"})


def load_old(path: Path) -> dict:
    """An old checkpoint's payload: a regular file (doors.opened), a torch.save zip, tensors and plain values only."""
    f, _ = through_door(doors.opened, path, "checkpoint", FIX)
    with f:
        if f.read(4) != b"PK\x03\x04":
            raise UserError(f"--ckpt={path} is not a torch.save file (a zip); a .safetensors checkpoint needs no "
                            f"conversion; {FIX}")
        f.seek(0)
        try:
            payload = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # damaged, cut short, or holding objects other than tensors and plain values
            raise UserError(f"--ckpt={path} cannot be read as a checkpoint ({first_line(e)[:200]}); {FIX}") from None
    if not isinstance(payload, dict):
        raise UserError(f"--ckpt={path} holds a {type(payload).__name__}, not a checkpoint's table; {FIX}")
    weights = payload.get("model")
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise UserError(f"--ckpt={path} is not a headless-lm checkpoint (no model weights); {FIX}")
    return payload


def refuse_existing(out: Path) -> None:
    if os.path.lexists(out):
        raise UserError(f"--out={out} exists; it is never replaced: move it away or pass another --out")


def convert(old: str | Path, out: str | Path) -> Path:
    """Write `out` from the old checkpoint `old`: built under a temp name beside it, read back through the checkpoint
    door, then linked to its name, which never replaces a file (one put there meanwhile included)."""
    old, out = Path(old), Path(out)
    refuse_existing(out)
    payload = load_old(old)
    tmp = safe_files.temp_path(out)
    try:
        try:
            save_checkpoint(tmp, payload)
            load_checkpoint(tmp, TrainConfig)
        except UserError as e:  # named as the user knows it: the new file's problem is the old file's
            raise UserError(str(e).replace(str(tmp), f"{old} (converted)")) from None
        except (TypeError, ValueError) as e:  # a value safetensors or JSON cannot hold (checkpoint.encode_checkpoint)
            raise UserError(f"--ckpt={old} cannot be converted: {first_line(e)[:200]}; {FIX}") from None
        try:
            os.link(tmp, out)
        except FileExistsError:
            refuse_existing(out)
        except OSError:  # a file system without hard links
            refuse_existing(out)
            os.rename(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str]) -> None:
    cfg = parse_flags(ConvertConfig, argv)
    if not cfg.ckpt or not cfg.out:
        raise UserError("pass --ckpt=OLD.pt (a checkpoint from before safetensors) and --out=NEW.safetensors")
    declare_io(reads={"--ckpt": cfg.ckpt, "--config": config_path(argv)}, writes={"--out": cfg.out})
    out = convert(cfg.ckpt, cfg.out)
    print(f"wrote {out}, a checkpoint every script reads", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
