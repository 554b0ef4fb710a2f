"""Device and precision: the device and dtype a command runs with, mixed precision, a GPU's peak FLOP/s (for
MFU), and every rank started alike. Plumbing a learner may skip."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
from typing import Any, Literal

import torch

import ddp
from common import UserError

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "bfloat16", "float16", "float32"]


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device=cuda but no CUDA GPU is visible; use --device=auto or --device=cpu")
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 on GPUs that have it, fp16 (with loss scaling) on older ones, fp32 on CPU."""
    if name == "float16" and device.type != "cuda":
        raise UserError("--dtype=float16 needs a CUDA GPU; on CPU use --dtype=float32 or bfloat16")
    if name == "auto" and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32 if name == "auto" else getattr(torch, name)


PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
              "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}  # dense bf16 FLOP/s, for MFU


def peak_flops(device: torch.device) -> float | None:
    """A GPU's peak, matched on whole words of its name ("NVIDIA H100 80GB HBM3"): an L40S is not an L4."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_FLOPS.items() if re.search(rf"\b{re.escape(k)}\b", name)), None)


def autocast_context(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the matmuls; the losses upcast their scores to fp32 themselves."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


def ranks_agree(settings: Any, device: torch.device, flag: bool) -> int:
    """In one all-reduce at a run's start: refuse ranks started with other settings (a 60-bit digest of each rank's,
    compared through the sums of its parts and of their squares, equal everywhere only if every rank's is the same), so
    that no rank trains another run or waits for ever for the others; and count the ranks where `flag` holds."""
    text = json.dumps(dataclasses.asdict(settings), sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).digest()
    parts = [int.from_bytes(digest[i:i + 3], "big") >> 4 for i in (0, 3, 6)]  # 20 bits each: squares sum exactly
    total = ddp.all_reduce_sum(torch.tensor([int(flag), *parts, *(p * p for p in parts)], dtype=torch.int64,
                                        device=device)).tolist()
    n = ddp.world_size()
    if any(n * squares != part * part for part, squares in zip(total[1:4], total[4:7], strict=True)):
        raise UserError("the ranks were started with different settings (their digests differ); start every rank "
                        "with the same flags and --config")
    return total[0]
