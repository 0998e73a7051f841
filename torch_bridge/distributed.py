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
    dist.init_process_group(backend=backend)
    return True


def all_reduce_sum(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum each tensor over all processes; new tensors out, one collective for the whole list."""
    if world_size() == 1:
        return tensors
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view(t.shape).to(t.dtype))
        offset += t.numel()
    return out
