"""Running an expert function only over the occupied rows of each expert's slab.

With dropless routing the [E, C, M] buffer is padded to the busiest expert; the
rows past an expert's real load hold no token.  ``megablocks_size = b`` asks
for each expert's first ceil(load / b) * b rows only (never more than C).
"""
from typing import Callable

import torch


def occupied_rows(dispatch_count: torch.Tensor, capacity: int, block: int) -> "list[int]":
    """Rows to compute per local expert: the load rounded up to `block`, at most `capacity`.

    Reads the counts on the host (one synchronisation, by design: the shapes depend on them)."""
    loads = dispatch_count.tolist()
    return [min(-(-int(load) // block) * block, capacity) for load in loads]


def grouped_apply(x: torch.Tensor, rows: "list[int]", expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
                  output_dim: int) -> torch.Tensor:
    """y[e, :rows[e]] = expert_fn(e, x[e, :rows[e]]), zero elsewhere; differentiable."""
    outputs = []
    capacity = x.shape[1]
    for expert, count in enumerate(rows):
        computed = expert_fn(expert, x[expert, :count]) if count > 0 else x.new_zeros((0, output_dim))
        if count < capacity:
            computed = torch.cat([computed, computed.new_zeros((capacity - count, output_dim))], dim=0)
        outputs.append(computed)
    return torch.stack(outputs, dim=0)


def flatten_features(x: torch.Tensor, model_dim: int, output_dim: int) -> torch.Tensor:
    """[L, tokens, *features] -> [L, tokens, model_dim].

    With reserve_dims > 1 a token spans several trailing dims; MLP experts act on all of
    them flattened and hand back the same shape, which needs output_dim == model_dim."""
    if x.dim() == 3:
        return x
    if output_dim != model_dim:
        raise ValueError(f"experts with output_dim={output_dim} != model_dim={model_dim} cannot restore a "
                         f"multi-dim token shape {tuple(x.shape[2:])} (reserve_dims > 1); use reserve_dims=1 "
                         f"or a custom expert")
    return x.reshape(x.shape[0], x.shape[1], model_dim)
