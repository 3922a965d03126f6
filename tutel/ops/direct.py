"""tutel's operators called directly, without the checks and autograd wrappers of tutel.ops.

Why a direct call exists: at decoding sizes (a few tokens, small experts) the fixed cost of a
call (the Python checks, the autograd.Function, the dispatcher) is as large as the operator's
own work, so the paths that run without autograd call these instead.  The functions here check
nothing in Python: their arguments must come from tutel's own plans (a RoutingPlan of
tutel.paths.plans, the layer's routing), whose shapes, dtypes and devices tutel made itself.  Anything else goes through the public wrappers (tutel.ops.encode / decode, ...).  The
C++ operators keep their own checks either way.

Three names are bound to compiled callables rather than defined here:

* ``routed_gated_experts``: the operator ``torch.ops.tutel.routed_gated_experts`` (through the
  dispatcher, which Python dispatch modes, tensor subclasses and profilers see);
* ``routed_gated_experts_cpu``: its CPU implementation bound in the extension, without the
  dispatcher: only for plain CPU tensors, no autograd, outside any Python dispatch mode (ask
  ``tutel.ops.tracing.direct_call_allowed``);
* ``route_without_grad``: the layer's default routing of softmax scores [T, E] on the CPU without
  autograd, ``route_without_grad(scores, k, normalize, capacity, batch_prioritized)`` -> (expert
  ids [T, k] int32, gate weights [T, k], choices per expert [E] int64, the GShard loss); it is a
  function of the extension only, not a registered operator.
"""
from typing import Optional

import torch

from .extension import load_extension

_EXTENSION = load_extension()  # registers torch.ops.tutel.* before the lookups below
_SCATTER_SLOTS = torch.ops.tutel.scatter_slots
_GATHER_SLOTS = torch.ops.tutel.gather_slots
_SELECT_ROWS = torch.ops.tutel.select_rows

routed_gated_experts = torch.ops.tutel.routed_gated_experts
routed_gated_experts_cpu = _EXTENSION.routed_gated_experts
route_without_grad = _EXTENSION.route_without_grad


def scatter_slots(x: torch.Tensor, indices: Optional[torch.Tensor], locations: torch.Tensor,
                  capacity: int) -> torch.Tensor:
    """The rows of `x` [T, M] copied into one expert's buffer of `capacity` slots: [1, capacity, M],
    row ``locations[j, t]`` holding ``x[t]`` (``torch.ops.tutel.scatter_slots`` with one expert, no
    weights and no dots).  `indices` [k, T] int32 or None (the grouped layout: every choice to
    expert 0); `locations` [k, T] int32, a location >= `capacity` dropped."""
    return _SCATTER_SLOTS(x, indices, locations, None, None, 1, capacity)[0]


def gather_slots(y: torch.Tensor, indices: Optional[torch.Tensor], locations: torch.Tensor,
                 gates: Optional[torch.Tensor]) -> torch.Tensor:
    """Each token's weighted sum of its kept choices' rows of `y` [E, C, O]: [T, O]
    (``torch.ops.tutel.gather_slots`` without dots).  `gates` [k, T] of any floating dtype and
    strides (read in place), or None for weight 1."""
    return _GATHER_SLOTS(y, indices, locations, gates, None)[0]


def select_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` for x [N, M] and rows [n] int64, in a buffer of the CPU block cache
    (``torch.ops.tutel.select_rows``; CPU only)."""
    return _SELECT_ROWS(x, rows)


__all__ = ["gather_slots", "route_without_grad", "routed_gated_experts", "routed_gated_experts_cpu",
           "scatter_slots", "select_rows"]
