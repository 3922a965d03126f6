"""Dispatch (encode) of token rows into expert slots and combine (decode) back.

encode:  out[e, l]  = g * x[t]                 for each kept choice (t, j) with slot (e, l)
decode:  out[t]     = sum_j g[j, t] * y[e, l]   over the kept choices of token t

A choice with location >= capacity is dropped: it is not dispatched and adds
nothing when combining.  ``gates=None`` means weight 1 (Tutel's
``is_postscore`` applies gates at decode time, so encode runs without them).
"""
from typing import Optional

import torch

from .checks import (
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
                grad_gates if x is not None else None, None, None)


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
                grad_gates if y is not None else None)


def _prepare_gates(gates, indices: torch.Tensor, data: torch.Tensor, where: str) -> Optional[torch.Tensor]:
    if gates is None:
        return None
    gates = stack_choices(gates, "gates", where)
    if not gates.dtype.is_floating_point:
        raise TypeError(f"{where}: `gates` must be floating point, got {gates.dtype}")
    if gates.shape != indices.shape:
        raise ValueError(f"{where}: `gates` must have shape [k, tokens] = {tuple(indices.shape)}, "
                         f"got {tuple(gates.shape)}")
    same_device(data, gates, "gates", where)
    return gates.to(accumulation_dtype(data.dtype))


def _prepare_table(indices, locations, data: torch.Tensor, where: str):
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
        num_experts, capacity: buffer shape.
        gates: optional [k, T] weights applied while dispatching (pre-scoring).

    Differentiable with respect to ``x`` and ``gates``.
    """
    where = "tutel.ops.encode"
    require_floating(x, "x", where)
    require_dim(x, 2, "x", where)
    num_experts = require_int(num_experts, "num_experts", where, minimum=1)
    capacity = require_int(capacity, "capacity", where, minimum=0)
    indices, locations = _prepare_table(indices, locations, x, where)
    if indices.shape[1] != x.shape[0]:
        raise ValueError(f"{where}: `x` has {x.shape[0]} tokens but `indices` describes "
                         f"{indices.shape[1]}")
    weights = _prepare_gates(gates, indices, x, where)
    return _Encode.apply(x, indices, locations, weights, num_experts, capacity)


def decode(y: torch.Tensor, indices, locations, gates=None) -> torch.Tensor:
    """Combines expert outputs back into token order.

    Args:
        y: [E, C, M] expert buffer.
        indices, locations: [k, T] integer tensors (or lists of k [T] tensors).
        gates: optional [k, T] weights (post-scoring); None means weight 1.

    Returns:
        [T, M]: for each token the gate-weighted sum of its kept slots (zeros if
        every choice was dropped).  Differentiable with respect to ``y`` and ``gates``.
    """
    where = "tutel.ops.decode"
    require_floating(y, "y", where)
    require_dim(y, 3, "y", where)
    indices, locations = _prepare_table(indices, locations, y, where)
    weights = _prepare_gates(gates, indices, y, where)
    return _Decode.apply(y, indices, locations, weights)
