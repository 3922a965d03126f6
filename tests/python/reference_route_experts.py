"""A plain-PyTorch float64 reference of tutel.ops.route_experts (docs/routing.md, csrc/core/route_experts.h):
the choice scores with the roundings to the logits' dtype the operator makes, the top-k by a stable sort,
GShard slots by counting, the grouped plan, and the weights and loss as differentiable float64 functions
of the logits (their gradients by autograd)."""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class Options(NamedTuple):
    k: int
    score_function: str = "softmax"
    softmax_after_topk: bool = False
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    batch_prioritized: bool = False
    capacity: int = -1
    with_loss: bool = True

    def kwargs(self):
        return {name: value for name, value in self._asdict().items() if name != "k"}


def rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values as a tensor of `dtype` holds them."""
    return values.to(dtype).to(torch.float64)


def scores(z: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "softmax":
        return torch.softmax(z, dim=1)
    if score_function == "sigmoid":
        return torch.sigmoid(z)
    return torch.sqrt(F.softplus(z))  # softplus(z) = z above 20, as the operator


def choice_scores(logits: torch.Tensor, o: Options, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """c [T, E] in float64, rounded where the operator rounds, with the group limit applied."""
    dtype = logits.dtype
    z = logits.double()
    c = z if o.softmax_after_topk else rounded(scores(z, o.score_function), dtype)
    if bias is not None:
        c = rounded(c + bias.to(dtype).double(), dtype)
    if o.n_group is None:
        return c
    tokens, experts = c.shape
    grouped = c.view(tokens, o.n_group, experts // o.n_group)
    best = grouped.topk(min(2, grouped.shape[2]), dim=2).values
    group_scores = best[..., 0] if best.shape[2] == 1 else rounded(best[..., 0] + best[..., 1], dtype)
    kept = torch.sort(group_scores, dim=1, descending=True, stable=True).indices[:, :o.topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~keep.unsqueeze(2), float("-inf")).view(tokens, experts)


def top_k(c: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] int64: the k largest, NaN first, ties (and +-0) to the lower index."""
    return torch.sort(c, dim=1, descending=True, stable=True).indices[:, :k]


def weights(z: torch.Tensor, ids: torch.Tensor, o: Options, dtype: torch.dtype) -> torch.Tensor:
    """[T, k] float64 weights of the chosen experts `ids` [T, k], differentiable in z [T, E] float64."""
    if o.softmax_after_topk:
        u = torch.softmax(z.gather(1, ids), dim=1)
    else:
        u = scores(z, o.score_function).gather(1, ids)
    if o.renormalize:
        u = u / u.sum(dim=1, keepdim=True).clamp(min=torch.finfo(dtype).eps)
    return u * o.routed_scaling_factor


def gshard_loss(z: torch.Tensor, first_choices: torch.Tensor, o: Options, dtype: torch.dtype) -> torch.Tensor:
    tokens, experts = z.shape
    if tokens == 0 or not o.with_loss:
        return z.new_zeros(())  # no gradient
    if o.score_function == "softmax":
        p = torch.softmax(z, dim=1)
    else:
        s = scores(z, o.score_function)
        p = s / s.sum(dim=1, keepdim=True).clamp(min=torch.finfo(dtype).tiny)
    share = torch.bincount(first_choices, minlength=experts).double() / tokens
    return experts * (p.mean(dim=0) * share).sum()


def claiming_order(priority: Optional[torch.Tensor], tokens: int) -> torch.Tensor:
    """Token order, or by descending priority: NaN first, +0 equal to -0, ties in token order."""
    if priority is None:
        return torch.arange(tokens)
    return torch.sort(priority, descending=True, stable=True).indices


def gshard_slots(ids: torch.Tensor, num_experts: int, order: torch.Tensor):
    """(locations [T, k], counts [k, E]): every first choice before any second choice, tokens of one
    choice in `order`."""
    tokens, k = ids.shape
    chosen = ids.tolist()
    locations = [[0] * k for _ in range(tokens)]
    counts = [[0] * num_experts for _ in range(k)]
    next_slot = [0] * num_experts
    for j in range(k):
        for t in order.tolist():
            e = chosen[t][j]
            locations[t][j] = next_slot[e]
            next_slot[e] += 1
            counts[j][e] += 1
    return torch.tensor(locations, dtype=torch.int64).view(tokens, k), torch.tensor(counts, dtype=torch.int64)


def grouped_plan(ids: torch.Tensor, locations: torch.Tensor, counts: torch.Tensor, capacity: int):
    """(grouped_locations [T, k], ends [E], row_choices [rows]) for a buffer of T k or E capacity rows."""
    tokens, k = ids.shape
    experts = counts.shape[1]
    rows = tokens * k if capacity < 0 else experts * capacity
    total = counts.sum(dim=0)
    kept = total if capacity < 0 else total.clamp(max=capacity)
    ends = torch.cumsum(kept, dim=0)
    starts = ends - kept
    grouped = [[rows] * k for _ in range(tokens)]
    row_choices = [tokens * k] * rows
    chosen, slots, first_rows = ids.tolist(), locations.tolist(), starts.tolist()
    for t in range(tokens):
        for j in range(k):
            slot = slots[t][j]
            if capacity < 0 or slot < capacity:
                row = first_rows[chosen[t][j]] + slot
                grouped[t][j] = row
                row_choices[row] = j * tokens + t
    return (torch.tensor(grouped, dtype=torch.int64).view(tokens, k), ends,
            torch.tensor(row_choices, dtype=torch.int64))
