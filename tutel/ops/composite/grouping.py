"""Ranks inside groups, with sorts and searches only (no bincount or scatter, which
have no deterministic CUDA implementation)."""
from typing import Tuple

import torch


def rank_in_group(groups: torch.Tensor, num_groups: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """For a 1-D int64 tensor of group numbers in [0, num_groups): (rank, sizes) where
    rank[i] counts the earlier entries of group groups[i] and sizes[g] the entries of g."""
    sorted_groups, positions = torch.sort(groups, stable=True)
    numbers = torch.arange(num_groups + 1, device=groups.device, dtype=groups.dtype)
    bounds = torch.searchsorted(sorted_groups, numbers)
    starts, sizes = bounds[:-1], bounds[1:] - bounds[:-1]
    rank = torch.empty_like(groups)
    rank[positions] = torch.arange(groups.numel(), device=groups.device) - starts[sorted_groups]
    return rank, sizes
