"""A checkpoint of this project in an older form converted, once, into the checkpoint every script reads: a ckpt.pt
that torch.save wrote, or a .safetensors of an earlier layout (checkpoint_format.earlier_layout). A script given one
refuses it in one line naming this command, with full paths, quoted for the shell, to paste from any folder:

    python convert.py --ckpt=out/ckpt.pt --out=out/ckpt.safetensors

A ckpt.pt is a pickle: it is read with torch.load(weights_only=True), which builds tensors and plain values only, yet
convert only a file you trust as your own (no other script reads a pickle). The new checkpoint passes the door every
script reads it through (checkpoint.read_checkpoint) and builds its model before it takes its name; an existing
--out is never replaced."""
from __future__ import annotations

import common  # noqa: F401 (first of all: a signal during the slow imports below is one line)

# isort: split
import os
import pickle
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

import checkpoint_format
import doors
import safe_files
from checkpoint import checkpoint_model, load_checkpoint, save_checkpoint
from cli import config_path, parse_flags
from common import UserError, first_line, run_main, through_door
from io_checks import declare_io
from train import TrainConfig

FIX = "pass a ckpt.pt or an earlier .safetensors checkpoint that train.py or finetune.py wrote"


@dataclass
class ConvertConfig:
    ckpt: str = field(default="", metadata={"help": "the older checkpoint (ckpt.pt, or an earlier .safetensors)"})
    out: str = field(default="", metadata={"help": "the safetensors checkpoint to write; it must not exist"})


def load_old(path: Path) -> dict:
    """An old checkpoint's payload, in today's layout: a regular file (doors.opened), a torch.save zip or a
    safetensors checkpoint of an earlier layout; model weights and the model_config to build them by."""
    f, _ = through_door(doors.opened, path, "checkpoint", FIX)
    with f:
        head = f.read(9)
        if head.startswith(b"PK\x03\x04"):
            f.seek(0)
            payload = unpickled(f, path)
        elif head[8:] != b"{":  # a safetensors file: its header's length, then the header, JSON
            raise UserError(f"--ckpt={path} is neither a torch.save file (a zip) nor a safetensors checkpoint; {FIX}")
        else:  # the checkpoint door's bytes, its checksum, its document; its layout is judged here
            payload = through_door(checkpoint_format.checkpoint_file, path)
            if checkpoint_format.earlier_layout(payload) is None:
                raise UserError(f"--ckpt={path} is a checkpoint of today's layout: it needs no conversion; pass it "
                                "to any script as it is")
    if not isinstance(payload, dict):
        raise UserError(f"--ckpt={path} holds a {type(payload).__name__}, not a checkpoint's table; {FIX}")
    weights = payload.get("model")
    if not isinstance(weights, dict) or not weights or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise UserError(f"--ckpt={path} is not a headless-lm checkpoint (no model weights); {FIX}")
    if "model_config" not in payload:  # checked before anything is written: no model can be built without it
        raise UserError(f"--ckpt={path} holds model weights but no model_config (the model's shape), so no script "
                        f"could build its model; {FIX}")
    return in_todays_layout(payload)


def unpickled(f: IO[bytes], path: Path) -> Any:
    """A torch.save zip's contents, read by torch's safe loader, which builds tensors and plain values only; its
    parts stored as torch.save stores them (a compressed part, as in a zip bomb, is refused before it inflates)."""
    try:
        packed = [i.filename for i in zipfile.ZipFile(f).infolist() if i.compress_type != zipfile.ZIP_STORED]
    except Exception as e:  # zipfile's errors of a damaged directory: BadZipFile, EOFError, ValueError...
        raise UserError(f"--ckpt={path} is a damaged zip ({first_line(e)[:120]}), not a torch.save file; {FIX}"
                        ) from None
    if packed:
        raise UserError(f"--ckpt={path} holds compressed parts ({doors.clip(packed[0])}), which torch.save never "
                        f"writes (a zip bomb's are): not a checkpoint of this project's; {FIX}")
    f.seek(0)
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's text advises an unsafe load: said here in the project's words
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"it would call {found[1]}" if found else "or damaged bytes"
        raise UserError(f"--ckpt={path} holds Python objects that torch's safe loader refuses to build ({what}); "
                        f"this project converts only its own checkpoints, which hold tensors and plain values; {FIX}"
                        ) from None
    except Exception as e:  # damaged or cut short: parts that disagree with what they claim
        raise UserError(f"--ckpt={path} cannot be read as a checkpoint ({first_line(e)[:120]}); {FIX}") from None


def in_todays_layout(payload: dict) -> dict:
    """A payload in today's layout (checkpoint_format.earlier_layout): the counts kept beside `state` dropped, or,
    without a state, made one that cannot resume exactly (no data position); val_step the step validated at (its
    step, where known); an import's source dropped; a disabled scaler none. The door checks the result."""
    legacy = {k: payload.pop(k) for k in checkpoint_format.EARLIER_COUNTS if k in payload}
    payload.pop("source", None)
    state = payload.get("state")
    if state is None and legacy:
        renamed = {"tokens_seen": "tokens", "base_tokens": "earlier_tokens", "base_flops": "earlier_flops"}
        state = payload["state"] = {"micro_batches": None, **{renamed.get(k, k): v for k, v in legacy.items()}}
    if isinstance(state, dict) and "val_step" not in state:
        state["val_step"] = legacy.get("step")
    if isinstance(payload.get("scaler"), dict) and not payload["scaler"]:
        payload["scaler"] = None
    return payload


def check_out(out: Path) -> None:
    if os.path.lexists(out):
        raise UserError(f"--out={out} exists; it is never replaced: move it away or pass another --out")
    if any(p.exists() and not p.is_dir() for p in out.parents):
        raise UserError(f"--out={out}: a folder above it is a file; pass --out in a folder")


def convert(old: str | Path, out: str | Path) -> Path:
    """Write `out` from the old checkpoint `old`: built under a temp name beside it, read back through the checkpoint
    door and its model built, then linked to its name, which never replaces a file (even one put there meanwhile)."""
    old, out = Path(old), Path(out)
    check_out(out)
    payload = load_old(old)
    tmp = safe_files.temp_path(out)
    try:
        try:
            save_checkpoint(tmp, payload)
            checkpoint_model(load_checkpoint(tmp, TrainConfig), tmp)
        except UserError as e:  # named as the user knows it: the new file's problem is the old file's
            raise UserError(str(e).replace(str(tmp), f"{old} (converted)")) from None
        except (TypeError, ValueError) as e:  # a value safetensors or JSON cannot hold (encode_checkpoint)
            raise UserError(f"--ckpt={old} cannot be converted: {first_line(e)[:200]}; {FIX}") from None
        try:
            os.link(tmp, out)
        except FileExistsError:
            check_out(out)
        except OSError:  # a file system without hard links
            check_out(out)
            os.rename(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str]) -> None:
    cfg = parse_flags(ConvertConfig, argv)
    if not cfg.ckpt or not cfg.out:
        raise UserError("pass --ckpt=OLD (a ckpt.pt or an earlier layout's .safetensors) and --out=NEW.safetensors")
    declare_io(reads={"--ckpt": cfg.ckpt, "--config": config_path(argv)}, writes={"--out": cfg.out})
    out = convert(cfg.ckpt, cfg.out)
    print(f"wrote {out}, a checkpoint every script reads", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
