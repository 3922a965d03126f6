"""Tutel's capacity rule: how many slots each expert's buffer has.

This is the single implementation of the rule and of rounding up to an
alignment (``align_up``, also used for the grouped experts' blocks); every path (routing API, MoE
layer, distributed layer) calls it.  It is plain host integer arithmetic, so
torch.compile can trace the static (capacity_factor > 0) case without a
device synchronisation.
"""
from typing import Callable, Optional


def samples_per_expert(num_tokens: int, num_experts: int) -> int:
    """ceil(num_tokens / num_experts): the fair share of tokens per expert."""
    return (num_tokens + num_experts - 1) // num_experts


def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of `alignment` that is >= value."""
    remainder = value % alignment
    return value if remainder == 0 else value + alignment - remainder


def capacity_alignment(sharded_count: int, overlap_degree: int, megablocks_size: int) -> int:
    """Multiple the capacity is rounded up to, so buffers split evenly over the processes sharing an
    expert and the overlap chunks, and into megablocks blocks (above 256, also to a multiple of 128)."""
    alignment = align_up(sharded_count * overlap_degree, max(megablocks_size, 1))
    if alignment > 256:
        alignment = align_up(alignment, 128)
    return alignment


def expert_capacity(capacity_factor: float, top_k: int, num_tokens: int, num_experts: int,
                    max_load: Optional[Callable[[], int]] = None, alignment: int = 1) -> int:
    """Slots per expert under Tutel's rule.

    * capacity_factor > 0: ``top_k * int(capacity_factor * ceil(T / E))`` (static:
      depends only on shapes, no device synchronisation);
    * capacity_factor == 0 (dropless): the largest per-expert load, so no
      token is dropped;
    * capacity_factor < 0: the largest load, capped at
      ``top_k * int(-capacity_factor * ceil(T / E))``.

    The result is rounded up to a multiple of `alignment`.

    Args:
        max_load: called only for capacity_factor <= 0; returns the largest
            number of choices routed to one expert (already reduced over all
            ranks that share the experts).
    """
    share = samples_per_expert(num_tokens, num_experts)
    if capacity_factor > 0:
        capacity = top_k * int(capacity_factor * share)
    else:
        if max_load is None:
            raise ValueError("a dynamic capacity (capacity_factor <= 0) needs the expert loads")
        capacity = int(max_load())
        if capacity_factor < 0:
            capacity = min(capacity, top_k * int(-capacity_factor * share))
    return align_up(capacity, alignment)


def realtime_capacity_factor(capacity: int, top_k: int, num_tokens: int, num_experts: int) -> float:
    """The capacity expressed as a capacity factor (what Tutel logs as 'real-time capacity-factor')."""
    share = samples_per_expert(num_tokens, num_experts)
    return capacity / (top_k * share) if share > 0 else 0.0
