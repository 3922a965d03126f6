"""Dispatch (encode) of token rows into expert slots and combine (decode) back.

encode:  out[e, l]  = g * x[t]                 for each kept choice (t, j) with slot (e, l)
decode:  out[t]     = sum_j g[j, t] * y[e, l]   over the kept choices of token t

A choice with location >= capacity is dropped: it is not dispatched and adds
nothing when combining.  ``gates=None`` means weight 1 (Tutel's
``is_postscore`` applies gates at decode time, so encode runs without them).

``indices=None`` is the grouped layout (tutel.experts.routed): every choice goes
to expert 0, whose slots hold the rows grouped by expert, and no table of zeros
is made.  For ``encode`` it also promises that no two kept choices name one
location, which lets CUDA skip the slot table (see tutel.ops.encode).  The
gates are read as they are (any floating dtype, any strides, e.g. ``w.t()`` of
a [T, k] tensor) and converted to the accumulation dtype inside the kernels;
their gradient is accumulated in that dtype and returned in the gates' dtype.
"""
from typing import Optional, Tuple

import torch

from .checks import (
    FLOATING_DTYPES,
    accumulation_dtype,
    as_slot_tensor,
    require_dim,
    require_floating,
    require_int,
    same_device,
    stack_choices,
)
from .backend import operators_for


class _Encode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, locations, gates, num_experts, capacity):
        out, _ = operators_for(x.device).scatter_slots(x, indices, locations, gates, None, num_experts, capacity)
        gate_grad = gates is not None and ctx.needs_input_grad[3]
        ctx.save_for_backward(x if gate_grad else None, indices, locations, gates)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, indices, locations, gates = ctx.saved_tensors
        grad_x, grad_gates = operators_for(grad_out.device).gather_slots(grad_out.contiguous(), indices, locations, gates, x)
        return (grad_x if ctx.needs_input_grad[0] else None, None, None,
                _in_dtype_of(grad_gates, gates) if x is not None else None, None, None)


class _Decode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, indices, locations, gates):
        out, _ = operators_for(y.device).gather_slots(y, indices, locations, gates, None)
        gate_grad = gates is not None and ctx.needs_input_grad[3]
        ctx.save_for_backward(y if gate_grad else None, indices, locations, gates)
        ctx.buffer_shape = y.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        y, indices, locations, gates = ctx.saved_tensors
        num_experts, capacity = ctx.buffer_shape[0], ctx.buffer_shape[1]
        grad_y, grad_gates = operators_for(grad_out.device).scatter_slots(
            grad_out.contiguous(), indices, locations, gates, y, num_experts, capacity)
        return (grad_y if ctx.needs_input_grad[0] else None, None, None,
                _in_dtype_of(grad_gates, gates) if y is not None else None)


class _CopyChoiceRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot_choices, locations):
        ctx.save_for_backward(locations)
        return operators_for(x.device).choice_rows(x, slot_choices, locations.shape[0])

    @staticmethod
    def backward(ctx, grad_rows):
        locations, = ctx.saved_tensors
        grad_rows = grad_rows.contiguous()
        grad_x, _ = operators_for(grad_rows.device).gather_slots(grad_rows.view(1, *grad_rows.shape), None,
                                                                  locations, None, None)
        return grad_x, None, None


def encode_grouped(x: torch.Tensor, slot_choices: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
    """The grouped rows of a routing plan (tutel.paths.plans.RoutingPlan) copied from the tokens:
    row s is ``x[slot_choices[s] // k]``, one launch of tutel's ``choice_rows`` (``encode`` with
    ``indices=None`` takes two: it must first find which choice names each slot, which the plan's
    ``slot_choices`` already say).  Differentiable in `x`: each token's gradient is the sum of its
    kept choices' rows (``decode`` without gates, in choice order: deterministic).

    Args:
        x: [T, M] token rows.
        slot_choices: [N] int64, the choice (t * k + j) each grouped row holds, every value in
            [0, T * k) (the dropped choices' rows too, which nobody reads).
        locations: [k, T] int32, the grouped row of each choice, N (or more) for dropped ones.

    Returns:
        [N, M] in x's dtype."""
    return _CopyChoiceRows.apply(x, slot_choices, locations)


def _in_dtype_of(grad_gates: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """The gates' gradient, accumulated by the operators in the data's accumulation dtype, in the
    gates' own dtype (as autograd expects; no copy when they already agree)."""
    return grad_gates.to(gates.dtype)


def _prepare_gates(gates, locations: torch.Tensor, data: torch.Tensor, where: str) -> Optional[torch.Tensor]:
    """The gates as a [k, T] tensor the operators read in place: float32 / float64 / bfloat16 /
    float16 of any strides stay as they are; other floating dtypes become the accumulation dtype."""
    if gates is None:
        return None
    gates = stack_choices(gates, "gates", where)
    if not gates.dtype.is_floating_point:
        raise TypeError(f"{where}: `gates` must be floating point, got {gates.dtype}")
    if gates.shape != locations.shape:
        raise ValueError(f"{where}: `gates` must have shape [k, tokens] = {tuple(locations.shape)}, "
                         f"got {tuple(gates.shape)}")
    same_device(data, gates, "gates", where)
    return _readable(gates, data)


def _readable(gates: Optional[torch.Tensor], data: torch.Tensor) -> Optional[torch.Tensor]:
    """Gates the operators read as they are (float32 / float64 / bfloat16 / float16, any strides);
    other floating dtypes in the data's accumulation dtype."""
    if gates is None or gates.dtype in FLOATING_DTYPES:
        return gates
    return gates.to(accumulation_dtype(data.dtype))


def _prepare_table(indices, locations, data: torch.Tensor, where: str
                   ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(indices or None, locations) as contiguous int32 [k, T] tensors on the data's device."""
    if indices is None:
        locations = as_slot_tensor(locations, "locations", where)
        same_device(data, locations, "locations", where)
        return None, locations
    indices = as_slot_tensor(indices, "indices", where)
    locations = as_slot_tensor(locations, "locations", where)
    if indices.shape != locations.shape:
        raise ValueError(f"{where}: `indices` and `locations` must have the same [k, tokens] shape, "
                         f"got {tuple(indices.shape)} and {tuple(locations.shape)}")
    same_device(data, indices, "indices", where)
    same_device(data, locations, "locations", where)
    return indices, locations


def encode(x: torch.Tensor, indices, locations, num_experts: int, capacity: int,
           gates=None) -> torch.Tensor:
    """Dispatches token rows into a zero-initialised [num_experts, capacity, M] buffer.

    Args:
        x: [T, M] token features (float32, float64, bfloat16 or float16).
        indices, locations: [k, T] integer tensors (or lists of k [T] tensors).
            ``indices=None``: every choice goes to expert 0 (the grouped layout), and the
            caller guarantees that each location below ``capacity`` is named by at most one
            choice (CUDA then writes the rows in two launches, without a slot table).  If two
            choices do name one location, the CPU sums them as usual but the result on CUDA
            is unspecified: one of them, any, is written and the others add nothing.
        num_experts, capacity: buffer shape.
        gates: optional [k, T] weights applied while dispatching (pre-scoring), any
            floating dtype and any strides (read in place).  Their gradient is returned in
            their dtype, accumulated in float32 (float64 for float64 data).

    Differentiable with respect to ``x`` and ``gates``.
    """
    where = "tutel.ops.encode"
    require_floating(x, "x", where)
    require_dim(x, 2, "x", where)
    num_experts = require_int(num_experts, "num_experts", where, minimum=1)
    capacity = require_int(capacity, "capacity", where, minimum=0)
    indices, locations = _prepare_table(indices, locations, x, where)
    if locations.shape[1] != x.shape[0]:
        raise ValueError(f"{where}: `x` has {x.shape[0]} tokens but `indices` describes "
                         f"{locations.shape[1]}")
    weights = _prepare_gates(gates, locations, x, where)
    return _Encode.apply(x, indices, locations, weights, num_experts, capacity)


def decode(y: torch.Tensor, indices, locations, gates=None) -> torch.Tensor:
    """Combines expert outputs back into token order.

    Args:
        y: [E, C, M] expert buffer.
        indices, locations: [k, T] integer tensors (or lists of k [T] tensors);
            ``indices=None``: every choice reads expert 0 (the grouped layout).
        gates: optional [k, T] weights (post-scoring); None means weight 1.  Any floating
            dtype and any strides (``weights.t()`` of a [T, k] tensor is read in place); their
            gradient comes back in their dtype, accumulated in float32 (float64 for float64 y).

    Returns:
        [T, M]: for each token the gate-weighted sum of its kept slots (zeros if
        every choice was dropped).  Differentiable with respect to ``y`` and ``gates``.
    """
    where = "tutel.ops.decode"
    require_floating(y, "y", where)
    require_dim(y, 3, "y", where)
    indices, locations = _prepare_table(indices, locations, y, where)
    weights = _prepare_gates(gates, locations, y, where)
    return _Decode.apply(y, indices, locations, weights)


def encode_planned(x: torch.Tensor, indices: Optional[torch.Tensor], locations: torch.Tensor, num_experts: int,
                   capacity: int, gates: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``encode`` for the tables of tutel's own routing, which need none of its checks: `indices`
    (or None) and `locations` int32 [k, T] on x's device, `gates` None or a floating [k, T] tensor
    there.  The execution paths call it once per call, where the checks would cost more Python than
    the rest of a small call."""
    if gates is not None and gates.dtype not in FLOATING_DTYPES:  # (_readable's test first: one call fewer)
        gates = _readable(gates, x)
    if not torch.is_grad_enabled():  # nothing records: the operator itself, without the autograd function
        return operators_for(x.device).scatter_slots(x, indices, locations, gates, None, num_experts, capacity)[0]
    return _Encode.apply(x, indices, locations, gates, num_experts, capacity)


def decode_planned(y: torch.Tensor, indices: Optional[torch.Tensor], locations: torch.Tensor,
                   gates: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``decode`` of an [E, C, M] buffer for the tables of tutel's own routing (see encode_planned)."""
    if gates is not None and gates.dtype not in FLOATING_DTYPES:  # (as encode_planned)
        gates = _readable(gates, y)
    if not torch.is_grad_enabled():  # (as encode_planned)
        return operators_for(y.device).gather_slots(y, indices, locations, gates, None)[0]
    return _Decode.apply(y, indices, locations, gates)
