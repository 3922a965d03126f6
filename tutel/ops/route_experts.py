"""Fused expert routing: the gate's logits to the chosen experts, their weights, GShard slots, the
grouped-rows plan and the GShard loss in one operator (torch.ops.tutel.route_experts), with autograd.

On CUDA the operator is two kernel launches and its backward one, with no host synchronisation:
every output's size follows from the logits' shape and the int arguments, so a call traces on fake
tensors and is captured by CUDA graphs.  On the CPU it runs csrc/core/route_experts.cpp, which gives
the CUDA kernels' bits.  Where the kernels fail the first-use self-check on a device
(tutel.ops.backend), the composite operator (tutel.ops.composite.route_experts) runs there instead,
differentiated by autograd.
"""
import math
from typing import NamedTuple, Optional

import torch

from .backend import operators_for
from .checks import require_dim, require_floating, require_int, require_top_k, same_device
from .tracing import eager_without_grad

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrt_softplus")
# The most groups the CUDA kernel's shared memory holds (kernels/kernel_abi.h, TUTEL_ROUTE_MAX_GROUPS).
MAX_GROUPS = 256


class ExpertRouting(NamedTuple):
    """Routing of T tokens to k of E experts; [k, T] tensors are choice-major (entry j, t: token t's
    j-th choice).  ``rows`` = T * k when dropless, else E * capacity."""

    expert_ids: torch.Tensor         # [k, T] int32, best first
    weights: torch.Tensor            # [k, T] float32 (float64 for float64 logits), differentiable
    locations: torch.Tensor          # [k, T] int32 GShard slot in the expert's buffer (>= capacity: dropped)
    counts: torch.Tensor             # [k, E] int32 choices per (choice, expert), before capacity
    dispatch_count: torch.Tensor     # [E] int64 choices per expert, before capacity
    grouped_locations: torch.Tensor  # [k, T] int32 row in the grouped buffer, `rows` when dropped
    ends: torch.Tensor               # [E] int32 where each expert's rows end (running sum of kept choices)
    row_choices: torch.Tensor        # [rows] int32 the choice j * T + t in each row, k * T when unused
    l_aux: torch.Tensor              # [] float32 (float64) GShard loss, differentiable; 0 without with_loss


class _RouteExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, score_function, softmax_after_topk, selection_bias, n_group, topk_group, renormalize,
                routed_scaling_factor, batch_prioritized, capacity, with_loss):
        outputs = torch.ops.tutel.route_experts(logits, k, score_function, softmax_after_topk, selection_bias,
                                                n_group, topk_group, renormalize, routed_scaling_factor,
                                                batch_prioritized, capacity, with_loss)
        expert_ids, counts = outputs[0], outputs[3]
        ctx.save_for_backward(logits, expert_ids, counts)
        ctx.settings = (score_function, softmax_after_topk, renormalize, routed_scaling_factor, with_loss)
        ctx.mark_non_differentiable(*(outputs[i] for i in (0, 2, 3, 4, 5, 6, 7)))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros launched
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        grad_weights, grad_loss = grads[1], grads[8]
        if grad_weights is None and grad_loss is None:
            return (None,) * 12
        logits, expert_ids, counts = ctx.saved_tensors
        grad_logits = torch.ops.tutel.route_experts_backward(grad_weights, grad_loss, logits, expert_ids, counts,
                                                             *ctx.settings)
        return (grad_logits,) + (None,) * 11


def _check_groups(n_group: Optional[int], topk_group: Optional[int], k: int, num_experts: int, where: str):
    """(n_group, topk_group) as the operator takes them: (0, 0) without a group limit."""
    if n_group is None and topk_group is None:
        return 0, 0
    if n_group is None or topk_group is None:
        raise ValueError(f"{where}: group-limited routing needs both n_group and topk_group, got n_group={n_group} "
                         f"and topk_group={topk_group}")
    n_group = require_int(n_group, "n_group", where, minimum=1)
    topk_group = require_int(topk_group, "topk_group", where, minimum=1)
    if num_experts % n_group != 0 or n_group > MAX_GROUPS:
        raise ValueError(f"{where}: n_group={n_group} is not allowed; it must divide the {num_experts} experts into "
                         f"equal groups and be at most {MAX_GROUPS}")
    if topk_group > n_group:
        raise ValueError(f"{where}: topk_group={topk_group} is not allowed; it must be <= n_group={n_group}")
    allowed = topk_group * (num_experts // n_group)
    if k > allowed:
        raise ValueError(f"{where}: k={k} exceeds the {allowed} experts of the topk_group={topk_group} groups a token "
                         f"may use; allowed: 1 <= k <= {allowed}")
    return n_group, topk_group


def _require_bool(value, name: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: `{name}` must be True or False, got {value!r}")
    return value


def route_experts(logits: torch.Tensor, k: int, *, score_function: str = "softmax", softmax_after_topk: bool = False,
                  selection_bias: Optional[torch.Tensor] = None, n_group: Optional[int] = None,
                  topk_group: Optional[int] = None, renormalize: bool = False, routed_scaling_factor: float = 1.0,
                  batch_prioritized: bool = False, capacity: int = -1, with_loss: bool = True) -> ExpertRouting:
    """Routes T tokens to k of E experts from the gate's logits [T, E] (noise already added).

    With z the logits, b the selection bias and round(x) the value x takes in the logits' dtype:

    * scores s = softmax(z), sigmoid(z) or sqrt(softplus(z)) (`score_function`), in the accumulation
      dtype (float32; float64 for float64 logits);
    * choice c = round(round(s) + round(b)), or round(z + round(b)) with `softmax_after_topk`
      (without a bias: round(s), or z); with `n_group` / `topk_group`, experts outside the token's
      topk_group best groups (a group scored by the sum of its two best c, rounded) get c = -inf;
    * the k experts with the largest c: NaN first, ties to the lower expert (and group) index;
    * weights u_j = s[e_j] (softmax over the chosen z with `softmax_after_topk`), divided by
      max(sum_j u_j, eps of the logits' dtype) when `renormalize`, times `routed_scaling_factor`;
      in the accumulation dtype;
    * GShard slots: every first choice before any second choice; tokens in order, or with
      `batch_prioritized` by descending top-1 c (NaN first, ties by token);
    * the grouped plan for a static buffer of T * k rows (``capacity=-1``, dropless) or E * capacity
      rows: the expert's first row plus the slot when the slot is below the capacity;
    * l_aux = E * sum_e mean_t(p[t, e]) * (share of tokens whose first choice is e), p = s for
      softmax scores, else s divided by its sum over the experts (the softmax over all logits with
      `softmax_after_topk`); 0 without tokens or `with_loss`.

    Gradients reach `logits` through `weights` and `l_aux` (not through the choice: bias and groups
    have none).  Returns an ExpertRouting; see docs/routing.md and csrc/core/route_experts.h.
    """
    where = "tutel.ops.route_experts"
    require_floating(logits, "logits", where)
    require_dim(logits, 2, "logits", where)
    num_experts = int(logits.shape[1])
    k = require_top_k(k, num_experts, where)
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"{where}: score_function={score_function!r} is not allowed; use one of "
                         f"{', '.join(SCORE_FUNCTIONS)}")
    softmax_after_topk = _require_bool(softmax_after_topk, "softmax_after_topk", where)
    if softmax_after_topk and score_function != "softmax":
        raise ValueError(f"{where}: softmax_after_topk=True takes a softmax over the chosen logits; it needs "
                         f"score_function='softmax', got {score_function!r}")
    if selection_bias is not None:
        if not isinstance(selection_bias, torch.Tensor) or selection_bias.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{where}: `selection_bias` must be a float32 or float64 tensor, got "
                            f"{getattr(selection_bias, 'dtype', type(selection_bias).__name__)}")
        if tuple(selection_bias.shape) != (num_experts,):
            raise ValueError(f"{where}: `selection_bias` must have shape [num_experts] = [{num_experts}], got "
                             f"{tuple(selection_bias.shape)}")
        same_device(logits, selection_bias, "selection_bias", where)
        selection_bias = selection_bias.detach()
    n_group, topk_group = _check_groups(n_group, topk_group, k, num_experts, where)
    renormalize = _require_bool(renormalize, "renormalize", where)
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)) or \
            not math.isfinite(routed_scaling_factor):
        raise ValueError(f"{where}: routed_scaling_factor must be a finite number, got {routed_scaling_factor!r}")
    batch_prioritized = _require_bool(batch_prioritized, "batch_prioritized", where)
    capacity = require_int(capacity, "capacity", where, minimum=-1)
    with_loss = _require_bool(with_loss, "with_loss", where)
    return _routed(logits, k, score_function, softmax_after_topk, selection_bias, n_group, topk_group, renormalize,
                   float(routed_scaling_factor), batch_prioritized, capacity, with_loss)


def route_experts_softmax(logits: torch.Tensor, k: int, renormalize: bool, batch_prioritized: bool,
                          capacity: int) -> ExpertRouting:
    """route_experts(logits, k, renormalize=, batch_prioritized=, capacity=) with the loss (Tutel's
    softmax top-k routing), for arguments a caller has checked already (moe_layer checks its call's
    switches once): no checks here, where they would cost more Python than the rest of the routing."""
    return _routed(logits, k, "softmax", False, None, 0, 0, renormalize, 1.0, batch_prioritized, capacity, True)


def _routed(logits: torch.Tensor, *settings) -> ExpertRouting:
    route = operators_for(logits.device).route_experts
    if route is not torch.ops.tutel.route_experts:
        # The composite operator, where the CUDA kernels failed tutel.ops.backend's self-check:
        # PyTorch's autograd differentiates it.
        return ExpertRouting(*route(logits, *settings))
    if eager_without_grad(logits):  # nothing to differentiate: no autograd wrapper
        return ExpertRouting(*route(logits, *settings))
    return ExpertRouting(*_RouteExperts.apply(logits, *settings))
