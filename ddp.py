"""Processes under torchrun (one per GPU; without it, this is rank 0 of 1): joining the group, which rank this
is, sums and barriers across ranks, a peer that failed. Plumbing a learner may skip; it imports no other file
of this project."""
from __future__ import annotations

import os

import torch


def peer_failed(error: BaseException) -> bool:
    """A collective that failed because another rank of the job is gone (it stopped on its own error)."""
    text = str(error)
    return torch.distributed.is_initialized() and (isinstance(error, torch.distributed.DistError) or any(
        words in text for words in ("Connection closed by peer", "Connection reset by peer", "remote worker")))


def init_distributed(device: torch.device) -> torch.device:
    """Under torchrun, join the process group (NCCL on GPUs, gloo on CPU); returns this rank's device."""
    if not all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        cuda = device.type == "cuda"
        torch.distributed.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return device


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_main_process() -> bool:
    return rank() == 0  # the one process that prints progress and writes logs and checkpoints


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        torch.distributed.all_reduce(values)
    return values


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


def launched_as_rank_0() -> bool:
    """Rank 0, also before the process group is joined (torchrun says which rank this is in RANK)."""
    return is_main_process() if torch.distributed.is_initialized() else os.environ.get("RANK", "0") == "0"


def wrapped(module: torch.nn.Module) -> torch.nn.Module:
    """`module` as each step runs it: under torchrun, in DDP (rank 0's weights to every rank at the start, gradients
    averaged over ranks in backward). Buffers are not broadcast at each forward: the model's are the same on every
    rank, and another may hold each rank's own state (a queue of its past targets); torch 2.13 renamed the argument."""
    if world_size() == 1:
        return module
    import inspect
    takes = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    own = {"forward_sync_buffers": False} if "forward_sync_buffers" in takes else {"broadcast_buffers": False}
    return torch.nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=True, **own)
