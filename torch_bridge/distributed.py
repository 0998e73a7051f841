"""Data parallelism for the torch step: one summing all-reduce per step over the process group.

The step sums gradients, loss and weight over its local micro-batches and calls :func:`all_reduce_sum`
once; every process then divides by the same global weight, so the result does not depend on how the
global batch was split across processes (up to float summation order).
"""

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    """Number of processes in the default group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_from_env() -> bool:
    """Join the process group described by torchrun-style env vars (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Returns True when this process is part of a group of more than one process. gloo on CPU, nccl on CUDA.
    """
    if world_size() > 1 or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return world_size() > 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():  # one GPU per local rank, or NCCL sees every rank on GPU 0
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend)
    return True


def local_rank() -> int:
    """This process's rank on its machine (torchrun's LOCAL_RANK; 0 when unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def any_process(flags: list[bool]) -> list[bool]:
    """Each flag OR-ed over all processes (one collective), so every process takes the same decision."""
    if world_size() == 1:
        return list(flags)
    device = torch.device("cuda", local_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")
    votes = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    return [bool(vote) for vote in votes.tolist()]


def all_reduce_sum(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum each tensor over all processes; new tensors out, one collective for the whole list."""
    if world_size() == 1:
        return tensors
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset : offset + t.numel()].view(t.shape).to(t.dtype))
        offset += t.numel()
    return out
