"""Per-expert linear maps: ``y = x @ W_e (+ b_e)`` for every expert e, forward and backward.

Two layouts of the tokens:

* batched: ``x`` is ``[E, C, K]`` (every expert has C rows, the padded expert buffer);
* grouped: ``x`` is ``[N, K]`` with the experts' rows stored one expert after the other and
  ``group_rows[e]`` rows for expert e (the dropless layout: no row is padding).

``weight`` is ``[E, K, O]``, or ``[E, O, K]`` (``nn.Linear``'s layout) with
``weight_transposed=True``.  Gradients come back in the weight's own layout, so no transposing
copy is made when they are accumulated.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F

from ..rules.autocast import any_autocast, autocast_dtype, without_autocast
from ..rules.lines import TOKEN_LINEAR_MAX_ROWS, UPCAST_MIN_ROWS_PER_EXPERT  # each line's reason: tutel/rules/lines.py
from .checks import require_dim, require_floating
from ._expert_loops import _right_factor, _weight_grad, grouped_linear_backward_loop, grouped_linear_loop  # noqa: F401
from .grouped_mm import grouped_rows_mm
from .precision import gemm_dtype, widened
from .tracing import eager_without_grad


_NARROW = (torch.bfloat16, torch.float16)  # the dtypes gemm_dtype may widen


def _autocast_operands(x, weight):
    """Under autocast, the GEMM operands in autocast's dtype (what autocast does for bmm / mm,
    which the operators below run on directly); float64 is left alone, as autocast does.  The
    bias keeps its dtype: adding it promotes the product, as ``matmul(x, w) + b`` does."""
    if not any_autocast():  # (one C call where autocast is off everywhere, the common case)
        return x, weight
    try:
        dtype = autocast_dtype(x.device.type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta)
        dtype = None
    if dtype is None:
        return x, weight
    return tuple(t if t.dtype in (dtype, torch.float64) else t.to(dtype) for t in (x, weight))


def _batched_product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     weight_transposed: bool) -> torch.Tensor:
    """x [E, C, K] times each expert's weight, plus its bias: one bmm / baddbmm."""
    right = weight.transpose(-1, -2) if weight_transposed else weight  # (_right_factor, inline)
    if bias is None:
        return torch.bmm(x, right)
    if bias.dtype == x.dtype:
        return torch.baddbmm(bias.unsqueeze(1), x, right)  # the bias is the GEMM's initial value
    return torch.bmm(x, right) + bias.unsqueeze(1)  # autocast: a wider bias promotes the low-precision product


class _BatchedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, weight_transposed):
        out = _batched_product(x, weight, bias, weight_transposed)
        ctx.weight_transposed = weight_transposed
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_bias = grad.sum(dim=1) if ctx.needs_input_grad[2] else None
        grad = grad.to(weight.dtype).contiguous()
        grad_x = torch.bmm(grad, _right_factor(weight, ctx.weight_transposed).transpose(1, 2)) \
            if ctx.needs_input_grad[0] else None
        grad_weight = _weight_grad(x, grad, ctx.weight_transposed) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, grad_bias, None


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group_rows, weight_transposed):
        if x.device.type == "cpu":
            out = torch.ops.tutel.grouped_linear(x, weight, bias, group_rows, weight_transposed)
        else:
            out = grouped_linear_loop(x, weight, bias, group_rows, weight_transposed)
        ctx.group_rows, ctx.weight_transposed = group_rows, weight_transposed
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mask = list(ctx.needs_input_grad[:3])
        if x.device.type == "cpu":
            grads = torch.ops.tutel.grouped_linear_backward(grad, x, weight, ctx.group_rows,
                                                            ctx.weight_transposed, mask)
        else:
            grads = grouped_linear_backward_loop(grad.contiguous(), x, weight, ctx.group_rows,
                                                 ctx.weight_transposed, mask)
        grad_x, grad_weight, grad_bias = (g if wanted else None for g, wanted in zip(grads, mask))
        return grad_x, grad_weight, grad_bias, None, None


def expert_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  weight_transposed: bool = False, group_rows: Optional[List[int]] = None) -> torch.Tensor:
    """``y = x @ W_e + b_e`` for every expert e, differentiable in x, weight and bias.

    Args:
        x: ``[E, C, K]`` (batched) or, with ``group_rows``, ``[N, K]`` rows grouped by expert.
        weight: ``[E, K, O]``, or ``[E, O, K]`` with ``weight_transposed=True``.
        bias: optional ``[E, O]``.
        group_rows: rows of each expert in ``x`` (sum = N); None for the batched layout.

    Returns:
        ``[E, C, O]`` or ``[N, O]``.  The grouped layout runs each expert's product only over its
        own rows, all from one operator call: tutel's grouped operator on CPU (it measured faster
        than ``torch.nn.functional.grouped_mm`` there), ``grouped_mm`` on other devices where
        PyTorch has it for the operands, else tutel's grouped kernels on CUDA and one product per
        expert elsewhere (``tutel.ops.grouped_mm.grouped_rows_mm``).  16-bit operands on a CPU
        without 16-bit dot products run in float32 once experts have enough rows
        (``tutel.ops.precision``).
    """
    where = "tutel.ops.expert_linear"
    require_floating(x, "x", where)
    require_dim(weight, 3, "weight", where)
    if group_rows is None:
        require_dim(x, 3, "x", where)
        if x.shape[0] != weight.shape[0]:
            raise ValueError(f"{where}: `x` holds {x.shape[0]} experts but `weight` {weight.shape[0]}")
    else:
        require_dim(x, 2, "x", where)
        group_rows = [int(count) for count in group_rows]
        if len(group_rows) != weight.shape[0] or any(count < 0 for count in group_rows) or \
                sum(group_rows) != x.shape[0]:
            raise ValueError(f"{where}: `group_rows` must hold {weight.shape[0]} non-negative counts summing to "
                             f"the {x.shape[0]} rows of `x`, got {group_rows}")
    return linear_of_experts(x, weight, bias, weight_transposed, group_rows)


def linear_of_experts(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      weight_transposed: bool, group_rows: Optional[List[int]]) -> torch.Tensor:
    """expert_linear for arguments of the shapes it checks (tutel's experts modules call it with
    their own weights on the layer's buffers; `group_rows` a list of ints)."""
    if any_autocast():  # (a C call: _autocast_operands only where autocast is on somewhere)
        x, weight = _autocast_operands(x, weight)
    rows_per_expert = x.shape[1] if group_rows is None else x.shape[0] / max(weight.shape[0], 1)
    # (gemm_dtype widens only 16-bit CPU operands past its line: asked only there)
    if x.dtype == weight.dtype and x.dtype in _NARROW and x.device.type == "cpu" and \
            rows_per_expert >= UPCAST_MIN_ROWS_PER_EXPERT:
        wide = gemm_dtype(x.dtype, x.device, rows_per_expert)
        if wide != x.dtype:  # 16-bit operands on a CPU without 16-bit dot products (tutel.ops.precision)
            out_dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
            # The operands are already autocast's; with autocast on, the float32 call would cast
            # them straight back to 16 bits (and recurse).
            with without_autocast(x.device.type):
                out = linear_of_experts(widened(x, wide), widened(weight, wide),
                                        None if bias is None else widened(bias, wide), weight_transposed, group_rows)
            return out.to(out_dtype)
    if group_rows is None:
        if not torch.is_grad_enabled():  # nothing records: the product without the autograd function
            return _batched_product(x, weight, bias, weight_transposed)
        return _BatchedLinear.apply(x, weight, bias, bool(weight_transposed))
    if x.device.type != "cpu" or (bias is not None and bias.dtype != x.dtype):
        # Off the CPU: grouped_rows_mm (grouped_mm where PyTorch has it for these operands, else
        # tutel's grouped kernels); a wider bias (autocast) is added after the product.
        ends = torch.tensor(group_rows, device=x.device).cumsum(0)
        out = grouped_rows_mm(x, weight, ends, transposed=not weight_transposed)
        if bias is None:
            return out
        counts = torch.tensor(group_rows, device=bias.device)
        return out + torch.repeat_interleave(bias, counts, dim=0, output_size=x.shape[0])
    if eager_without_grad(x, weight, bias):  # the operator itself: the autograd wrapper costs as much as T=1's product
        return torch.ops.tutel.grouped_linear(x, weight, bias, group_rows, bool(weight_transposed))
    return _GroupedLinear.apply(x, weight, bias, group_rows, bool(weight_transposed))


def token_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for [T, K] token rows (a router's logits).

    PyTorch's 16-bit CPU linear has a fixed cost per call (larger with the caches cold) that
    outweighs what a decoding step's router multiplies; so 16-bit rows on the CPU, up to
    TOKEN_LINEAR_MAX_ROWS of them (tutel/rules/lines.py), with nothing differentiated, traced or
    autocast, go through tutel's grouped operator as one group (its skinny products: sums in
    float, rounded once, as PyTorch's).  Everything else is ``F.linear``."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= TOKEN_LINEAR_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.dim() == 2
            and (bias is None or bias.dtype == x.dtype) and not (any_autocast() and autocast_dtype("cpu") is not None)
            and eager_without_grad(x, weight, bias)):
        return torch.ops.tutel.grouped_linear(x, weight.unsqueeze(0), None if bias is None else bias.unsqueeze(0),
                                              [x.shape[0]], True)
    return F.linear(x, weight, bias)
