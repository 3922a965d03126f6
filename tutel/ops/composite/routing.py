"""route_topk and assign_locations as PyTorch operations."""
from typing import Optional, Tuple

import torch

from .entries import raise_bad_entry
from .grouping import rank_in_group
from .ranking import claiming_order, descending_keys

_INT32_MAX = 2 ** 31 - 1


def _slots_in_order(indices: torch.Tensor, num_experts: int, order: Optional[torch.Tensor]
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """GShard slot assignment of valid indices [k, T]: every first choice before any
    second choice; within one choice, tokens in `order` (token order if None).
    Entries outside [0, num_experts) get location 2^31-1 and are not counted."""
    k, tokens = indices.shape
    experts = num_experts
    claimed = indices.long() if order is None else indices.long().index_select(1, order)
    valid = (claimed >= 0) & (claimed < experts)
    choice = torch.arange(k, device=indices.device).unsqueeze(1)
    # Group of an entry: (choice, expert), numbered choice-major; invalid entries share one extra group.
    group = torch.where(valid, choice * experts + claimed, torch.full_like(claimed, k * experts)).flatten()
    # Rank inside the group, in claiming order: entries are flattened choice-major and
    # then in claiming order, and the ranking keeps that order inside a group.
    rank, group_sizes = rank_in_group(group, k * experts + 1)
    counts = group_sizes[: k * experts].view(k, experts)
    # Slots of choice j start after the expert's slots of choices 0..j-1.
    earlier_choices = (torch.cumsum(counts, 0) - counts).flatten()
    base = torch.cat([earlier_choices, earlier_choices.new_zeros(1)])[group]
    claimed_slots = torch.where(valid.flatten(), base + rank, torch.full_like(rank, _INT32_MAX)).view(k, tokens)
    locations = torch.empty((k, tokens), dtype=torch.int32, device=indices.device)
    if order is None:
        locations.copy_(claimed_slots)
    else:
        locations[:, order] = claimed_slots.to(torch.int32)
    return locations, counts.to(torch.int32)


def assign_locations(indices: torch.Tensor, num_experts: int,
                     priority: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Slots for the expert choices `indices` ([k, T] int32): (locations [k, T] int32,
    counts [k, E] int32); with `priority` [T], higher-priority tokens claim first.
    Raises IndexError for an index outside [0, num_experts)."""
    op = "assign_locations"
    if indices.dim() != 2 or indices.dtype != torch.int32:
        raise ValueError(f"tutel::{op}: `indices` must be a 2-D int32 tensor, got {indices.dtype} "
                         f"of shape {tuple(indices.shape)}")
    if num_experts < 1:
        raise ValueError(f"tutel::{op}: num_experts={num_experts} must be in [1, 2^31-1]")
    if priority is not None and tuple(priority.shape) != (indices.shape[1],):
        raise ValueError(f"tutel::{op}: `priority` must have one entry per token ({indices.shape[1]}), "
                         f"got shape {tuple(priority.shape)}")
    raise_bad_entry(op, indices, num_experts)
    order = claiming_order(priority) if priority is not None and indices.shape[1] > 0 else None
    return _slots_in_order(indices, num_experts, order)


def route_topk(scores: torch.Tensor, k: int, batch_prioritized: bool
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k experts of every token of `scores` [T, E] and their slots.

    Returns (indices [k, T] int32, gates [k, T] in scores' dtype, locations [k, T]
    int32, counts [k, E] int32).  Best first; NaN ranks above every number; equal
    scores (and -0 / +0) go to the lower expert index.  With `batch_prioritized`
    tokens claim slots in descending order of their top-1 score.
    """
    op = "route_topk"
    if scores.dim() != 2:
        raise ValueError(f"tutel::{op}: `scores` must be 2-D, got shape {tuple(scores.shape)}")
    tokens, experts = scores.shape
    if experts < 1:
        raise ValueError(f"tutel::{op}: scores must have at least one expert column")
    if not 1 <= k <= experts:
        raise ValueError(f"tutel::{op}: k={k} is not allowed; k must satisfy 1 <= k <= num_experts={experts}")
    chosen = torch.sort(descending_keys(scores), dim=1, stable=True).indices[:, :k]  # [T, k]
    indices = chosen.t().to(torch.int32).contiguous()
    gates = scores.gather(1, chosen).t().contiguous()
    order = claiming_order(gates[0]) if batch_prioritized and tokens > 0 else None
    locations, counts = _slots_in_order(indices, experts, order)
    return indices, gates, locations, counts
