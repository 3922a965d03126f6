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

from ..paths.plans import occupied_rows


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
