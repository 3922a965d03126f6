"""Grouped expert execution (``megablocks_size = b``): each expert computes only over the rows
its tokens occupy, rounded up to blocks of b, never over padding.

In a single process the MoE layer dispatches the tokens straight into a grouped buffer: the
experts' rows one after another, ``rows[e] = min(ceil(load_e / b) * b, capacity)`` of them, so
there is no [E, C, M] buffer padded to the busiest expert at all.  Built-in experts run their
GEMMs on that buffer with ``tutel.ops.expert_linear(..., group_rows=rows)``.
"""
from typing import Callable, List

import torch
import torch.nn.functional as F

from ..rules.capacity import align_up


def occupied_rows(dispatch_count: torch.Tensor, capacity: int, block: int) -> List[int]:
    """Rows to compute per local expert: the load rounded up to `block`, at most `capacity`.

    Reads the counts on the host (one synchronisation, by design: the shapes depend on them)."""
    loads = dispatch_count.tolist()
    return [min(align_up(int(load), block), capacity) for load in loads]


def grouped_locations(crit, rows: List[int]) -> "tuple[torch.Tensor, torch.Tensor, int]":
    """The routing of `crit` re-targeted at the grouped buffer.

    Slot (e, l) becomes row ``offset[e] + l`` of one [N, M] buffer, described as a single
    "expert" with capacity N = sum(rows), so the ordinary encode / decode operators fill and read
    it.  Dropped choices (l >= capacity, or a negative expert index) get location N, which is
    dropped as well.

    Returns (indices [k, T] of zeros, locations [k, T], N)."""
    num_experts, indices_s, locations_s, _, capacity, *_ = crit  # not crit[:5]: PyTorch 2.6's torch.compile fails on it
    indices, locations = choice_table(indices_s), choice_table(locations_s)
    total = sum(rows)
    starts = torch.tensor([0] + rows[:-1], dtype=torch.int64, device=indices.device).cumsum(0)
    grouped = (starts[indices.long().clamp(min=0)] + locations).to(torch.int32)
    # A negative expert index (Tutel's "not dispatched") is dropped like a location >= capacity.
    kept = (locations < capacity) & (indices >= 0)
    grouped = torch.where(kept, grouped, torch.full_like(grouped, total))
    return torch.zeros_like(indices), grouped, total


def choice_table(choices) -> torch.Tensor:
    """[k, T] from Tutel's list of k [T] tensors (or a [k, T] tensor).  The lists of
    extract_critical are the rows of one [k, T] tensor (unbind): that tensor is used as it is."""
    if not isinstance(choices, (list, tuple)):
        return choices
    base = choices[0]._base if len(choices) else None
    if base is not None and base.dim() == 2 and base.shape[0] == len(choices) and all(
            c._base is base and c.storage_offset() == base.storage_offset() + j * base.stride(0) and
            c.shape[0] == base.shape[1] and c.stride(0) == base.stride(1) for j, c in enumerate(choices)):
        return base
    return torch.stack(list(choices))


def grouped_apply(x: torch.Tensor, rows: List[int],
                  grouped_fn: Callable[[torch.Tensor, List[int]], torch.Tensor]) -> torch.Tensor:
    """For an [E, C, M] buffer: y[e, :rows[e]] = the grouped computation on those rows, zero
    elsewhere (experts called directly with ``ctx.megablocks_size`` on a padded buffer)."""
    capacity = x.shape[1]
    packed = torch.cat([x[expert, :count] for expert, count in enumerate(rows)], dim=0)
    y = grouped_fn(packed, rows)
    pieces = [F.pad(piece, (0, 0, 0, capacity - count)) for piece, count in zip(y.split(rows), rows)]
    return torch.stack(pieces, dim=0)


def run_padded(x: torch.Tensor, ctx, compute: Callable, model_dim: int, output_dim: int) -> torch.Tensor:
    """Runs an expert computation on a padded [L, C, *features] buffer: ``compute(h, group_rows)``
    on [L, C, model_dim] (group_rows None), or only on each expert's occupied rows when the call
    has ``megablocks_size > 0``; the result takes the token shape of `x` back."""
    features = flatten_features(x, model_dim, output_dim)
    if getattr(ctx, "megablocks_size", 0) > 0:
        rows = occupied_rows(ctx.local_dispatch_count, features.shape[1], ctx.megablocks_size)
        y = grouped_apply(features, rows, compute)
    else:
        y = compute(features, None)
    return y.view(x.shape) if x.dim() > 3 else y


def flatten_features(x: torch.Tensor, model_dim: int, output_dim: int, batch_dims: int = 2) -> torch.Tensor:
    """[*batch, *features] -> [*batch, model_dim] (batch = [L, tokens], or [rows] when grouped).

    With reserve_dims > 1 a token spans several trailing dims; MLP experts act on all of
    them flattened and hand back the same shape, which needs output_dim == model_dim."""
    if x.dim() == batch_dims + 1:
        return x
    if output_dim != model_dim:
        raise ValueError(f"experts with output_dim={output_dim} != model_dim={model_dim} cannot restore a "
                         f"multi-dim token shape {tuple(x.shape[batch_dims:])} (reserve_dims > 1); use reserve_dims=1 "
                         f"or a custom expert")
    return x.reshape(*x.shape[:batch_dims], model_dim)
