"""Top-k routing and GShard slot assignment."""
from typing import NamedTuple, Optional

import torch

from .checks import as_slot_tensor, require_dim, require_floating, require_int, require_top_k, same_device
from .backend import operators_for
from .tracing import eager_without_grad


class RoutingResult(NamedTuple):
    """Routing of T tokens to k of E experts (all [k, T] tensors are choice-major)."""

    indices: torch.Tensor    # [k, T] int32: expert of each choice, best first
    gates: torch.Tensor      # [k, T]: the score of that expert (differentiable w.r.t. scores)
    locations: torch.Tensor  # [k, T] int32: slot inside the expert's buffer, in GShard order
    counts: torch.Tensor     # [k, E] int32: tokens per expert for each choice


class _RouteTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, k, batch_prioritized):
        indices, gates, locations, counts = operators_for(scores.device).route_topk(scores, k, batch_prioritized)
        ctx.save_for_backward(indices)
        ctx.scores_shape = scores.shape
        ctx.mark_non_differentiable(indices, locations, counts)
        return indices, gates, locations, counts

    @staticmethod
    def backward(ctx, _grad_indices, grad_gates, _grad_locations, _grad_counts):
        (indices,) = ctx.saved_tensors
        grad_scores = grad_gates.new_zeros(ctx.scores_shape)
        grad_scores.scatter_add_(1, indices.t().long(), grad_gates.t())
        return grad_scores, None, None


def route_topk(scores: torch.Tensor, k: int, batch_prioritized: bool = False) -> RoutingResult:
    """Selects the top-k experts of every token and assigns each choice a slot.

    Args:
        scores: [T, E] routing scores (usually softmax probabilities); float32,
            float64, bfloat16 or float16.
        k: experts per token, 1 <= k <= E.
        batch_prioritized: if True, tokens with a higher top-1 score claim
            slots first (so they survive capacity truncation); otherwise tokens
            claim slots in order.

    Returns:
        RoutingResult(indices, gates, locations, counts). Every token's first
        choice is placed before any token's second choice (GShard order);
        ``gates`` carries gradients back to ``scores``.
    """
    where = "tutel.ops.route_topk"
    require_floating(scores, "scores", where)
    require_dim(scores, 2, "scores", where)
    k = require_top_k(k, scores.shape[1], where)
    return route_topk_unchecked(scores, k, bool(batch_prioritized))


def route_topk_unchecked(scores: torch.Tensor, k: int, batch_prioritized: bool) -> RoutingResult:
    """route_topk for arguments the caller has validated (the C++ operator keeps its own checks)."""
    if eager_without_grad(scores):  # nothing to differentiate: the autograd wrapper costs as much as T=1's routing
        return RoutingResult(*operators_for(scores.device).route_topk(scores, k, batch_prioritized))
    return RoutingResult(*_RouteTopK.apply(scores, k, batch_prioritized))


def assign_locations(indices, num_experts: int,
                     priority: Optional[torch.Tensor] = None) -> "tuple[torch.Tensor, torch.Tensor]":
    """GShard slot assignment for given expert choices.

    Args:
        indices: [k, T] integer tensor (or list of k [T] tensors) of expert ids in [0, E).
        num_experts: E.
        priority: optional [T] floating tensor; tokens with a higher priority
            claim slots first (ties keep token order).

    Returns:
        (locations [k, T] int32, counts [k, E] int32).
    """
    where = "tutel.ops.assign_locations"
    indices = as_slot_tensor(indices, "indices", where)
    num_experts = require_int(num_experts, "num_experts", where, minimum=1)
    if priority is not None:
        require_floating(priority, "priority", where)
        same_device(indices, priority, "priority", where)
    return operators_for(indices.device).assign_locations(indices, num_experts, priority)
