"""Grouped matrix product over rows sorted by expert, with the group ends as a tensor.

``grouped_rows_mm(rows, weight, offsets, transposed)``: rows [N, K] hold expert 0's rows, then
expert 1's, ...; expert e owns rows ``offsets[e-1]:offsets[e]``.  Row i of the result is
``rows[i] @ W_e^T`` (weight [E, O, K], ``F.linear`` layout) or ``rows[i] @ W_e`` (weight
[E, K, O], ``transposed=True``).  Rows past ``offsets[-1]`` belong to no expert: their result
rows and gradient rows are zero.

Unlike ``expert_linear(group_rows=...)`` the group sizes stay on the device, so callers trace
under ``torch.compile(fullgraph=True)`` without a graph break: the operator is opaque to the
tracer.  On CPU it runs tutel's compiled grouped operator (reading the group ends costs nothing
there), whose skinny products read each expert's matrix once for groups of up to 32 rows: it
beat ``torch.nn.functional.grouped_mm`` up to 32 rows per expert and matched it above
(benchmarks/grouped_gemm.py);
on CUDA it runs ``grouped_mm`` where PyTorch has a kernel for the operands (bfloat16 on sm80+,
16-byte aligned strides), else one product per expert.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ._expert_loops import grouped_linear_backward_loop, grouped_linear_loop
from .tracing import eager_without_grad

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (1 in t.stride()[-2:] and all(stride == 1 or stride * size % 16 == 0 for stride in t.stride())
            and t.data_ptr() % 16 == 0)


def grouped_mm_supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch.nn.functional.grouped_mm has a kernel for operands `a` and `b` here."""
    if not hasattr(F, "grouped_mm") or a.dtype != b.dtype:
        return False
    if a.device.type == "cpu":
        ok = a.dtype in _CPU_DTYPES
    elif a.device.type == "cuda":
        ok = a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (8, 0)
    else:
        ok = False
    return ok and _aligned(a) and _aligned(b)


def _right(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return weight if transposed else weight.transpose(-1, -2)  # [E, K, O]


def _counts(offsets: torch.Tensor) -> List[int]:
    ends = offsets.tolist()
    return [end - start for start, end in zip([0] + ends[:-1], ends)]


def _zero_tail(t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Zeroes the rows past the last group, which grouped_mm leaves unwritten."""
    if t.device.type == "cpu":  # reading the end is free on the host
        t[int(offsets[-1]):] = 0
        return t
    rows = torch.arange(t.shape[0], device=t.device).unsqueeze(1)
    return t.masked_fill_(rows >= offsets[-1], 0)


def _use_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device.type != "cpu" and a.shape[0] > 0 and grouped_mm_supports(a, b)


def _forward(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    right = _right(weight, transposed)
    if _use_grouped_mm(rows, right):
        return _zero_tail(F.grouped_mm(rows, right, offs=offsets), offsets)
    counts = _counts(offsets)
    kept = sum(counts)
    run = torch.ops.tutel.grouped_linear if rows.device.type == "cpu" else grouped_linear_loop
    if kept == rows.shape[0]:  # no dropped rows (the usual case): no zero tail to add
        return run(rows, weight, None, counts, not transposed)  # rows may be a row-strided view
    out = rows.new_zeros((rows.shape[0], right.shape[-1]))
    if kept:
        out[:kept] = run(rows[:kept], weight, None, counts, not transposed)
    return out


def _backward(grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool,
              need_rows: bool, need_weight: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    grad = grad.contiguous()
    right = _right(weight, transposed)
    if _use_grouped_mm(grad, right) and grouped_mm_supports(rows, right):
        grad_rows = F.grouped_mm(grad, right.transpose(-1, -2), offs=offsets) if need_rows else None
        grad_weight = None
        if need_weight:
            # 2-D x 2-D grouped product: one [K, O] (or [O, K]) block per expert, zero for idle ones.
            grad_weight = F.grouped_mm(rows.t(), grad, offs=offsets) if transposed \
                else F.grouped_mm(grad.t(), rows, offs=offsets)
        return None if grad_rows is None else _zero_tail(grad_rows, offsets), grad_weight
    counts = _counts(offsets)
    kept = sum(counts)
    mask = [need_rows, need_weight, False]
    if rows.device.type == "cpu":
        grads = torch.ops.tutel.grouped_linear_backward(grad[:kept], rows[:kept].contiguous(), weight, counts,
                                                        not transposed, mask)
    else:
        grads = grouped_linear_backward_loop(grad[:kept], rows[:kept], weight, counts, not transposed, mask)
    grad_rows = None
    if need_rows:
        grad_rows = grads[0] if kept == rows.shape[0] else torch.cat([grads[0], rows.new_zeros(
            (rows.shape[0] - kept, rows.shape[1]))])
    return grad_rows, (grads[1] if need_weight else None)


@torch.library.custom_op("tutel::grouped_rows_mm", mutates_args=())
def _grouped_rows_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    return _forward(rows, weight, offsets, transposed)


@_grouped_rows_mm.register_fake
def _grouped_rows_mm_fake(rows, weight, offsets, transposed):
    return rows.new_empty((rows.shape[0], weight.shape[2] if transposed else weight.shape[1]))


@torch.library.custom_op("tutel::grouped_rows_mm_backward", mutates_args=())
def _grouped_rows_mm_backward(grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                              transposed: bool, need_rows: bool, need_weight: bool) -> List[torch.Tensor]:
    grad_rows, grad_weight = _backward(grad, rows, weight, offsets, transposed, need_rows, need_weight)
    return [rows.new_empty((0,)) if grad_rows is None else grad_rows,
            weight.new_empty((0,)) if grad_weight is None else grad_weight]


@_grouped_rows_mm_backward.register_fake
def _grouped_rows_mm_backward_fake(grad, rows, weight, offsets, transposed, need_rows, need_weight):
    return [rows.new_empty(rows.shape if need_rows else (0,)), weight.new_empty(weight.shape if need_weight else (0,))]


def _setup_context(ctx, inputs, output):
    rows, weight, offsets, transposed = inputs
    ctx.save_for_backward(rows, weight, offsets)
    ctx.transposed = transposed


def _autograd_backward(ctx, grad):
    rows, weight, offsets = ctx.saved_tensors
    need_rows, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_rows, grad_weight = torch.ops.tutel.grouped_rows_mm_backward(grad, rows, weight, offsets, ctx.transposed,
                                                                      need_rows, need_weight)
    return (grad_rows if need_rows else None, grad_weight if need_weight else None, None, None)


_grouped_rows_mm.register_autograd(_autograd_backward, setup_context=_setup_context)


def grouped_rows_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                    transposed: bool = False) -> torch.Tensor:
    """[N, K] rows sorted by expert times their expert's matrix -> [N, O] (see the module docstring).

    Args:
        rows: [N, K] in the weight's dtype.
        weight: [E, O, K] (``F.linear`` layout), or [E, K, O] with ``transposed=True``.
        offsets: [E] int32, offsets[e] = end of expert e's rows (non-decreasing, <= N).
        transposed: the weight's layout.
    """
    offsets = offsets.to(torch.int32)
    if eager_without_grad(rows, weight):
        # Nothing to trace or differentiate: skip the custom operator's dispatch (a tenth of a
        # millisecond, as much as a decoding step's product of a small expert).
        return _forward(rows, weight, offsets, bool(transposed))
    return _grouped_rows_mm(rows, weight, offsets, bool(transposed))
