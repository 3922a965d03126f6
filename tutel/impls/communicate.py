"""Minimal process-group queries and reductions used by routing.

Every function works without torch.distributed being initialised (world of 1).
"""
from typing import Optional

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: Optional["dist.ProcessGroup"] = None) -> int:
    """Size of `group` (default: WORLD); 1 when torch.distributed is not initialised."""
    return dist.get_world_size(group) if is_distributed() else 1


def get_world_rank(group: Optional["dist.ProcessGroup"] = None) -> int:
    """This process's rank in `group` (default: WORLD); 0 when not initialised."""
    return dist.get_rank(group) if is_distributed() else 0


def simple_all_reduce(input: torch.Tensor, group: Optional["dist.ProcessGroup"] = None,
                      op=None, inplace: bool = False) -> torch.Tensor:
    """All-reduce without autograd; returns a new tensor unless `inplace`."""
    op = dist.ReduceOp.SUM if op is None else op
    output = input if inplace else input.clone()
    if get_world_size(group) > 1:
        dist.all_reduce(output, op=op, group=group)
    return output


def all_reduce_max_int(value: int, device: torch.device,
                       group: Optional["dist.ProcessGroup"] = None) -> int:
    """The maximum of a host integer over `group` (one small collective when distributed)."""
    if get_world_size(group) == 1:
        return int(value)
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())
