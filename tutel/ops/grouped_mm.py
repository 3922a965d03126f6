"""Grouped matrix product over rows sorted by expert, with the group ends as a tensor.

``grouped_rows_mm(rows, weight, offsets, transposed)``: rows [N, K] hold expert 0's rows, then
expert 1's, ...; expert e owns rows ``offsets[e-1]:offsets[e]``.  Row i of the result is
``rows[i] @ W_e^T`` (weight [E, O, K], ``F.linear`` layout) or ``rows[i] @ W_e`` (weight
[E, K, O], ``transposed=True``).  Rows past ``offsets[-1]`` belong to no expert: their result
rows and gradient rows are zero, or left unspecified with ``zero_tail=False`` for callers that
never read them (on devices grouped_mm leaves them unwritten, and zeroing them is a pass over
the whole [N, O] result: a sixth of a Qwen3-MoE-sized experts call at 2048 tokens on an H200).

Unlike ``expert_linear(group_rows=...)`` the group sizes stay on the device, so callers trace
under ``torch.compile(fullgraph=True)`` without a graph break: the operator is opaque to the
tracer.  Where PyTorch's ``grouped_mm`` has no kernel for the operands it runs tutel's
``grouped_rows_linear`` operator.  On CPU (reading the group ends costs nothing there) its
skinny products read each expert's matrix once for groups of up to 32 rows (fewer where
PyTorch's GEMM has units they do not use: 6-8 for bfloat16 beside AMX, and with only the AVX2
build 8 for float32 beside Intel's AVX-512), and bfloat16 groups past that on AMX tiles where
the CPU has them (up to 256 rows of [O, K] weights, 64 of [K, O]): it beat
``torch.nn.functional.grouped_mm`` up to 32 rows per expert and matched it above
(benchmarks/grouped_gemm.py, docs/design.md);
on CUDA it runs ``grouped_mm`` where PyTorch has a kernel for the operands (bfloat16 on sm80+,
16-byte aligned strides), else tutel's tiled grouped kernels (kernels/grouped_rows_gemm.cu: float32,
float16, float64 and unaligned rows; one launch forward, two backward), which read the group ends
on the device too: no host synchronisation either way.  Only the composite fallback (tutel built
without CUDA, or ``TUTEL_CUDA_BACKEND=composite``) runs one product per expert and reads the ends
back to the host.
"""
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .backend import _ACTIVE_MODE, _FAKE_KEY, cuda_capability, operators_for
from .tracing import _FAKE_TENSOR, eager_without_grad

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HAS_GROUPED_MM = hasattr(F, "grouped_mm")


# Whether a CUDA device's compute capability has bfloat16 grouped_mm kernels (sm80+), by device
# and fake mode: fixed for a device, asked by every product.
_BF16_GROUPED: Dict[Tuple[str, bool], bool] = {}


def grouped_mm_supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch.nn.functional.grouped_mm has a kernel for operands `a` and `b` here."""
    return _use_grouped_mm(a, b, for_rows=False)


# Whether the CPU's products take grouped_mm too (tests take the devices' path on the CPU with it);
# by default the CPU runs tutel's grouped operator, which beats grouped_mm there.
_GROUPED_MM_ON_CPU = False


def _use_grouped_mm(a: torch.Tensor, b: torch.Tensor, for_rows: bool = True) -> bool:
    """Whether grouped_mm has a kernel for `a` and `b` here; with `for_rows`, whether a product of
    rows `a` by `b` runs it: at least one row, on a device (the CPU only with _GROUPED_MM_ON_CPU)."""
    if for_rows and (a.shape[0] == 0 or (a.device.type == "cpu" and not _GROUPED_MM_ON_CPU)):
        return False
    if not _HAS_GROUPED_MM or a.dtype != b.dtype:
        return False
    kind = a.device.type
    if kind == "cpu":
        if a.dtype not in _CPU_DTYPES:
            return False
    elif kind == "cuda" and a.dtype == torch.bfloat16:
        key = (str(a.device), _FAKE_KEY is not None and _ACTIVE_MODE(_FAKE_KEY) is not None)
        ok = _BF16_GROUPED.get(key)
        if ok is None:
            ok = _BF16_GROUPED[key] = cuda_capability(a.device) >= (8, 0)
        if not ok:
            return False
    else:
        return False
    # Both operands start on 16 bytes and have 16-byte strides but a unit one among their last two.
    for t in (a, b):  # (loops, not all(...): a generator costs a call per item)
        size = t.element_size()
        # A fake tensor has no address: its storage starts aligned, as an allocator's blocks do.
        if (t.storage_offset() * size if _FAKE_TENSOR is not None and isinstance(t, _FAKE_TENSOR)
                else t.data_ptr()) % 16:
            return False
        strides = t.stride()
        if 1 not in strides[-2:]:
            return False
        for stride in strides:
            if stride != 1 and stride * size % 16:
                return False
    return True


def _zero_tail(t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Zeroes the rows past the last group, which grouped_mm leaves unwritten."""
    if t.device.type == "cpu":  # reading the end is free on the host
        t[int(offsets[-1]):] = 0
        return t
    rows = torch.arange(t.shape[0], device=t.device).unsqueeze(1)
    return t.masked_fill_(rows >= offsets[-1], 0)


def bias_costs_a_launch(rows: torch.Tensor, weight: torch.Tensor, transposed: bool) -> bool:
    """Whether grouped_rows_mm(rows, weight, ..., bias=) would add the bias in a launch of its own
    (beside grouped_mm, on devices) instead of inside the products (the CPU's GEMMs, the
    per-expert loop's addmm): a caller whose next kernel can take the bias for free (the gated
    unit) passes it there instead."""
    return _use_grouped_mm(rows, weight if transposed else weight.transpose(-1, -2))


def grouped_rows_mm_eager(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool,
                          bias: Optional[torch.Tensor] = None, zero_tail: bool = True) -> torch.Tensor:
    """grouped_rows_mm for a call nothing records or traces (``tutel.ops.tracing.eager_without_grad``
    of its tensors, which the caller asked once for several products): the product itself, without
    the custom operator's dispatch.  `offsets` int32; the arguments are grouped_rows_mm's."""
    if bias is not None and bias.dtype != rows.dtype:
        bias = bias.to(rows.dtype)
    right = weight if transposed else weight.transpose(-1, -2)  # [E, K, O]
    if _use_grouped_mm(rows, right):
        out = F.grouped_mm(rows, right, offs=offsets)
        if bias is not None:  # one launch: each row's expert found in the offsets (the tail untouched)
            operators_for(out.device).add_expert_bias_(out, bias, offsets)
        return _zero_tail(out, offsets) if zero_tail else out
    # tutel's grouped operator: the bias inside the products, zeros past the last end either way.
    return operators_for(rows.device).grouped_rows_linear(rows, weight, bias, offsets, transposed)


def _backward(grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool,
              need_rows: bool, need_weight: bool, need_bias: bool = False, zero_tail: bool = True
              ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    grad = grad.contiguous()
    right = weight if transposed else weight.transpose(-1, -2)
    if _use_grouped_mm(grad, right) and grouped_mm_supports(rows, right):
        grad_rows = F.grouped_mm(grad, right.transpose(-1, -2), offs=offsets) if need_rows else None
        grad_weight = grad_bias = None
        if need_weight:
            # 2-D x 2-D grouped product: one [K, O] (or [O, K]) block per expert, zero for idle ones.
            grad_weight = F.grouped_mm(rows.t(), grad, offs=offsets) if transposed \
                else F.grouped_mm(grad.t(), rows, offs=offsets)
        if need_bias:  # per-expert sums of the gradient rows, in float32, in one launch
            grad_bias = operators_for(grad.device).expert_row_sums(grad, offsets)
        if grad_rows is not None and zero_tail:
            grad_rows = _zero_tail(grad_rows, offsets)
        return grad_rows, grad_weight, grad_bias
    mask = [need_rows, need_weight, need_bias]
    grads = operators_for(rows.device).grouped_rows_linear_backward(grad, rows, weight, offsets, transposed, mask)
    return tuple(g if need else None for g, need in zip(grads, mask))


@torch.library.custom_op("tutel::grouped_rows_mm", mutates_args=())
def _grouped_rows_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool,
                     bias: Optional[torch.Tensor] = None, zero_tail: bool = True) -> torch.Tensor:
    return grouped_rows_mm_eager(rows, weight, offsets, transposed, bias, zero_tail)


@_grouped_rows_mm.register_fake
def _grouped_rows_mm_fake(rows, weight, offsets, transposed, bias=None, zero_tail=True):
    return rows.new_empty((rows.shape[0], weight.shape[2] if transposed else weight.shape[1]))


@torch.library.custom_op("tutel::grouped_rows_mm_backward", mutates_args=())
def _grouped_rows_mm_backward(grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                              transposed: bool, need_rows: bool, need_weight: bool,
                              need_bias: bool, zero_tail: bool = True) -> List[torch.Tensor]:
    grad_rows, grad_weight, grad_bias = _backward(grad, rows, weight, offsets, transposed, need_rows, need_weight,
                                                  need_bias, zero_tail)
    return [rows.new_empty((0,)) if grad_rows is None else grad_rows,
            weight.new_empty((0,)) if grad_weight is None else grad_weight,
            grad.new_empty((0,)) if grad_bias is None else grad_bias]


@_grouped_rows_mm_backward.register_fake
def _grouped_rows_mm_backward_fake(grad, rows, weight, offsets, transposed, need_rows, need_weight, need_bias,
                                   zero_tail=True):
    outputs = weight.shape[2] if transposed else weight.shape[1]
    return [rows.new_empty(rows.shape if need_rows else (0,)), weight.new_empty(weight.shape if need_weight else (0,)),
            grad.new_empty((weight.shape[0], outputs) if need_bias else (0,))]


def _setup_context(ctx, inputs, output):
    rows, weight, offsets, transposed = inputs[:4]
    ctx.save_for_backward(rows, weight, offsets)
    ctx.transposed = transposed
    ctx.zero_tail = inputs[5] if len(inputs) > 5 else True


def _autograd_backward(ctx, grad):
    rows, weight, offsets = ctx.saved_tensors
    needs = ctx.needs_input_grad  # a bias left at its default is not among the inputs
    need_rows, need_weight, need_bias = needs[0], needs[1], len(needs) > 4 and needs[4]
    grad_rows, grad_weight, grad_bias = torch.ops.tutel.grouped_rows_mm_backward(
        grad, rows, weight, offsets, ctx.transposed, need_rows, need_weight, need_bias, ctx.zero_tail)
    grads = (grad_rows if need_rows else None, grad_weight if need_weight else None, None, None,
             grad_bias if need_bias else None, None)
    return grads[:len(needs)]


_grouped_rows_mm.register_autograd(_autograd_backward, setup_context=_setup_context)


def grouped_rows_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                    transposed: bool = False, bias: Optional[torch.Tensor] = None, *,
                    zero_tail: bool = True) -> torch.Tensor:
    """[N, K] rows sorted by expert times their expert's matrix (+ its bias) -> [N, O] (see the
    module docstring).

    Args:
        rows: [N, K] in the weight's dtype.
        weight: [E, O, K] (``F.linear`` layout), or [E, K, O] with ``transposed=True``.
        offsets: [E] int32, offsets[e] = end of expert e's rows (non-decreasing, <= N).
        transposed: the weight's layout.
        bias: [E, O] in the weight's dtype, added to each expert's rows (not to the rows past
            offsets[-1], which stay zero and send it no gradient); on CPU it rides in the
            products (the GEMM's addmm, the skinny products' sums), on devices beside grouped_mm it
            is one launch of tutel's ``add_expert_bias_`` (and its gradient one of
            ``expert_row_sums``), each row's expert found in the offsets.
        zero_tail: False leaves the result rows past offsets[-1], and the gradient of those rows,
            unspecified (any values, NaN included) instead of zero; for callers that never read
            them.  The rows of the experts and every other gradient are the same either way.
    """
    offsets = offsets.to(torch.int32)
    if bias is not None and bias.dtype != rows.dtype:
        bias = bias.to(rows.dtype)
    if eager_without_grad(rows, weight, bias):
        # Nothing to trace or differentiate: skip the custom operator's dispatch (a tenth of a
        # millisecond, as much as a decoding step's product of a small expert).
        return grouped_rows_mm_eager(rows, weight, offsets, bool(transposed), bias, bool(zero_tail))
    if zero_tail:  # the operator's defaults: its schema and traces stay as they were
        return _grouped_rows_mm(rows, weight, offsets, bool(transposed), bias)
    return _grouped_rows_mm(rows, weight, offsets, bool(transposed), bias, bool(zero_tail))
