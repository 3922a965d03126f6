"""``route_experts`` as plain PyTorch operations, with the arguments and the nine results of
``torch.ops.tutel.route_experts`` (the rules are csrc/core/route_experts.h's).

The choices, slots, counts and the grouped plan are the compiled operator's bit for bit wherever
the scores it compares are the same numbers: the choice scores are rounded to the logits' dtype as
the operator rounds them, ranked by the operator's rule (NaN first, ties to the lower index), and the
slots come from the same slot assignment as ``route_topk``'s.  The scores themselves (softmax,
sigmoid, softplus) and the weights and loss are PyTorch's, so they agree with the operator's to
rounding.  The weights and the loss are differentiable through autograd (the operator has its own
backward; here PyTorch's autograd stands in for it).  No host synchronisation: every size follows
from the shapes and the integer arguments.
"""
from typing import Optional, Tuple

import torch

from .ranking import claiming_order, descending_keys
from .routing import _slots_in_order

_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrt_softplus")
_DATA_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check(logits: torch.Tensor, k: int, score_function: str, softmax_after_topk: bool,
           selection_bias: Optional[torch.Tensor], n_group: int, topk_group: int, capacity: int) -> None:
    """The checks of csrc/ops/route_experts_args.cpp, with its messages' content."""
    where = "tutel::route_experts"
    if logits.dim() != 2 or logits.dtype not in _DATA_DTYPES:
        raise ValueError(f"{where}: `logits` must be a 2-D float32, float64, bfloat16 or float16 tensor, got "
                         f"{logits.dtype} of shape {tuple(logits.shape)}")
    experts = logits.shape[1]
    if not 1 <= k <= experts:
        raise ValueError(f"{where}: k={k} is not allowed; k must satisfy 1 <= k <= num_experts={experts}")
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(f"{where}: score_function={score_function!r} is not allowed; use one of "
                         f"{', '.join(_SCORE_FUNCTIONS)}")
    if softmax_after_topk and score_function != "softmax":
        raise ValueError(f"{where}: softmax_after_topk needs score_function='softmax', got {score_function!r}")
    if selection_bias is not None:
        if selection_bias.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{where}: `selection_bias` must be float32 or float64, got {selection_bias.dtype}")
        if tuple(selection_bias.shape) != (experts,):
            raise ValueError(f"{where}: `selection_bias` must be [{experts}], got {tuple(selection_bias.shape)}")
    if n_group == 0:
        if topk_group != 0:
            raise ValueError(f"{where}: topk_group={topk_group} needs n_group >= 1")
    elif n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group or k > topk_group * (experts // n_group):
        raise ValueError(f"{where}: n_group={n_group}, topk_group={topk_group} are not allowed for {experts} experts "
                         f"and k={k}: n_group must divide the experts, 1 <= topk_group <= n_group and k <= "
                         "topk_group * experts / n_group")
    if capacity < -1:
        raise ValueError(f"{where}: capacity={capacity} is not allowed; use -1 (dropless) or a number >= 0")


def _rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a tensor of `dtype` would hold them, back in their own dtype."""
    return values.to(dtype).to(values.dtype)


def _scores(z: torch.Tensor, score_function: str) -> torch.Tensor:
    """s [T, E] in z's (accumulation) dtype; softplus is z itself above 20."""
    if score_function == "softmax":
        return torch.softmax(z, dim=1)
    if score_function == "sigmoid":
        return torch.sigmoid(z)
    return torch.nn.functional.softplus(z, beta=1.0, threshold=20.0).sqrt()


def _best(values: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the `count` largest values along the last dim: NaN first, ties to the lower
    position (route_topk's rule)."""
    return torch.sort(descending_keys(values), dim=-1, stable=True).indices[..., :count]


def _limit_groups(choice: torch.Tensor, n_group: int, topk_group: int, dtype: torch.dtype) -> torch.Tensor:
    """choice with -inf for the experts outside each token's topk_group best groups; a group scores
    round(best + second best) (its best alone for groups of one expert)."""
    tokens, experts = choice.shape
    size = experts // n_group
    grouped = choice.view(tokens, n_group, size)
    best = grouped.gather(2, _best(grouped, min(2, size)))
    group_scores = best[..., 0] if size < 2 else _rounded(best[..., 0] + best[..., 1], dtype)
    kept = torch.zeros(tokens, n_group, dtype=torch.bool, device=choice.device)
    kept.scatter_(1, _best(group_scores, topk_group), True)
    outside = (~kept).unsqueeze(2).expand(tokens, n_group, size).reshape(tokens, experts)
    return choice.masked_fill(outside, float("-inf"))


def _grouped_plan(expert_ids: torch.Tensor, locations: torch.Tensor, dispatch_count: torch.Tensor, capacity: int,
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grouped_locations [k, T], ends [E], row_choices [rows]) of the static grouped buffer."""
    k, tokens = expert_ids.shape
    experts = dispatch_count.shape[0]
    rows = tokens * k if capacity < 0 else experts * capacity
    kept_count = dispatch_count if capacity < 0 else dispatch_count.clamp(max=capacity)
    ends = kept_count.cumsum(0)
    first_row = (ends - kept_count).index_select(0, expert_ids.reshape(-1).long()).view(k, tokens)
    kept = locations < capacity if capacity >= 0 else torch.ones_like(locations, dtype=torch.bool)
    grouped_locations = torch.where(kept, first_row + locations, torch.full_like(first_row, rows))
    row_choices = torch.full((rows + 1,), k * tokens, dtype=torch.int32, device=expert_ids.device)
    choice_numbers = torch.arange(k * tokens, dtype=torch.int32, device=expert_ids.device)
    # Kept choices own distinct rows; dropped ones all write the spare last entry, cut off below.
    row_choices.scatter_(0, grouped_locations.reshape(-1), torch.where(kept.reshape(-1), choice_numbers,
                                                                         torch.full_like(choice_numbers, k * tokens)))
    return grouped_locations.to(torch.int32), ends.to(torch.int32), row_choices[:rows]


def route_experts(logits: torch.Tensor, k: int, score_function: str, softmax_after_topk: bool,
                  selection_bias: Optional[torch.Tensor], n_group: int, topk_group: int, renormalize: bool,
                  routed_scaling_factor: float, batch_prioritized: bool, capacity: int, with_loss: bool
                  ) -> Tuple[torch.Tensor, ...]:
    """(expert_ids [k, T] int32, weights [k, T], locations [k, T] int32, counts [k, E] int32,
    dispatch_count [E] int64, grouped_locations [k, T] int32, ends [E] int32, row_choices [rows]
    int32, l_aux []) of logits [T, E], as tutel::route_experts; weights and l_aux in the
    accumulation dtype (float64 for float64 logits, else float32)."""
    _check(logits, k, score_function, softmax_after_topk, selection_bias, n_group, topk_group, capacity)
    tokens, experts = logits.shape
    dtype = logits.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    z = logits.to(acc)
    s = _scores(z, score_function)
    choice = z.detach() if softmax_after_topk else _rounded(s.detach(), dtype)
    if selection_bias is not None:
        choice = _rounded(choice + _rounded(selection_bias.detach().to(acc), dtype), dtype)
    if n_group > 0:
        choice = _limit_groups(choice, n_group, topk_group, dtype)
    chosen = _best(choice, k)  # [T, k] int64
    if softmax_after_topk:
        u = torch.softmax(z.gather(1, chosen), dim=1)
    else:
        u = s.gather(1, chosen)
    if renormalize:
        total = u.sum(1, keepdim=True)
        eps = torch.finfo(dtype).eps
        u = u / torch.where(total < eps, torch.full_like(total, eps), total)
    weights = (u * routed_scaling_factor).t().contiguous()
    expert_ids = chosen.t().to(torch.int32).contiguous()
    order = None
    if batch_prioritized and tokens > 0:
        order = claiming_order(choice.gather(1, chosen[:, :1]).squeeze(1).to(dtype))
    locations, counts = _slots_in_order(expert_ids, experts, order)
    dispatch_count = counts.sum(0, dtype=torch.int64)
    grouped_locations, ends, row_choices = _grouped_plan(expert_ids, locations, dispatch_count, capacity)
    if with_loss and tokens > 0:
        p = s
        if score_function != "softmax":
            norm = s.sum(1, keepdim=True)
            tiny = torch.finfo(dtype).tiny
            p = s / torch.where(norm < tiny, torch.full_like(norm, tiny), norm)
        shares = counts[0].to(acc) / tokens
        l_aux = ((p.sum(0) / tokens) * shares).sum() * experts
    else:
        l_aux = z.reshape(-1)[:0].sum()  # 0, recorded by autograd as the operator's output is
    return (expert_ids, weights, locations.to(torch.int32), counts, dispatch_count, grouped_locations, ends,
            row_choices, l_aux)
