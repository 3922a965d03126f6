"""Grouped expert products with the group ends known on the host: one ``torch.mm`` / ``torch.addmm``
per expert that has rows, forward and backward.

``per_expert_mm(rows, weight, ends, transposed, bias)`` is ``grouped_rows_mm`` (tutel.ops.grouped_mm)
for a caller that has read the group ends back (a list of ints): expert e owns rows
``ends[e-1]:ends[e]`` and row i of the result is ``rows[i] @ W_e^T`` (weight [E, O, K]) or
``rows[i] @ W_e`` (weight [E, K, O], ``transposed=True``), plus ``bias[e]``.  Each product is
PyTorch's matrix product, so on CUDA it is cuBLAS: tensor cores for float16, TF32 for float32 where
``torch.backends.cuda.matmul.allow_tf32`` / ``torch.set_float32_matmul_precision`` allow it, as for
any ``torch.mm``; float64 on the GPU's float64 units.  PyTorch's ``grouped_mm`` has no kernel for
these dtypes and tutel's own grouped kernel (kernels/grouped_rows_gemm.cu) runs on CUDA cores, so
where a host read of the ends is allowed (tutel.rules.paths: eager CUDA calls, not under graph
capture or torch.compile) this is the faster product.

Why one product per expert rather than the rows padded to an [E, max rows, K] batch and one
``bmm``: the routed experts' callers (transformers' models at inference) see unbalanced loads, and
padding multiplies the work and the memory by the largest load over the mean (by up to E when one
expert takes every token), and reads every expert's matrices, idle ones included; one product per
expert computes exactly the routed rows and reads only the busy experts' matrices, at the cost of
two launches per busy expert forward (four backward), which the GPU runs while the host
queues the next.  Each result slice is written in place (``out=``), so no concatenation follows.
"""
from typing import List, Optional, Sequence, Tuple

import torch

from .backend import operators_for


def expert_spans(ends: Sequence[int], rows: int) -> Tuple[List[Tuple[int, int, int]], int]:
    """``([(expert, begin, end), ...] for the experts with rows, last end)`` of group ends read as
    the grouped kernels read them: the running maximum, clamped to [0, rows]."""
    spans, begin = [], 0
    for expert, end in enumerate(ends):
        end = min(max(int(end), begin), rows)
        if end > begin:
            spans.append((expert, begin, end))
        begin = end
    return spans, begin


def _forward(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], spans, last: int,
             transposed: bool, zero_tail: bool) -> torch.Tensor:
    out = rows.new_empty((rows.shape[0], weight.shape[2] if transposed else weight.shape[1]))
    for expert, begin, end in spans:
        right = weight[expert] if transposed else weight[expert].t()  # [K, O]
        if bias is None:
            torch.mm(rows[begin:end], right, out=out[begin:end])
        else:  # the bias is the product's initial value: no launch of its own
            torch.addmm(bias[expert], rows[begin:end], right, out=out[begin:end])
    if zero_tail and last < out.shape[0]:
        out[last:].zero_()
    return out


class _PerExpertMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, bias, offsets, spans, last, transposed, zero_tail):
        ctx.save_for_backward(rows, weight, offsets)
        ctx.spans, ctx.last, ctx.transposed, ctx.zero_tail = spans, last, transposed, zero_tail
        return _forward(rows, weight, bias, spans, last, transposed, zero_tail)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        rows, weight, offsets = ctx.saved_tensors
        spans, transposed = ctx.spans, ctx.transposed
        need_rows, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad = grad.contiguous()
        grad_rows = grad_weight = grad_bias = None
        # Idle experts get zero gradients: one fill where any expert is idle, none otherwise.
        idle = len(spans) < weight.shape[0]
        if need_rows:
            grad_rows = rows.new_empty(rows.shape)
            for expert, begin, end in spans:
                left = weight[expert].t() if transposed else weight[expert]  # [O, K]
                torch.mm(grad[begin:end], left, out=grad_rows[begin:end])
            if ctx.zero_tail and ctx.last < rows.shape[0]:
                grad_rows[ctx.last:].zero_()
        if need_weight:
            grad_weight = (torch.zeros if idle else torch.empty)(weight.shape, dtype=weight.dtype,
                                                                 device=weight.device)
            for expert, begin, end in spans:
                if transposed:  # [K, O] = rows^T grad
                    torch.mm(rows[begin:end].t(), grad[begin:end], out=grad_weight[expert])
                else:  # [O, K] = grad^T rows
                    torch.mm(grad[begin:end].t(), rows[begin:end], out=grad_weight[expert])
        if need_bias and offsets is not None:  # tutel's per-expert row sums: one launch for every expert
            grad_bias = operators_for(grad.device).expert_row_sums(grad, offsets)
        elif need_bias:
            grad_bias = (torch.zeros if idle else torch.empty)((weight.shape[0], grad.shape[1]), dtype=grad.dtype,
                                                               device=grad.device)
            for expert, begin, end in spans:
                torch.sum(grad[begin:end], dim=0, out=grad_bias[expert])
        return grad_rows, grad_weight, grad_bias, None, None, None, None, None


def per_expert_mm(rows: torch.Tensor, weight: torch.Tensor, ends: Sequence[int], transposed: bool = False,
                  bias: Optional[torch.Tensor] = None, *, zero_tail: bool = True,
                  offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N, K] rows sorted by expert times their expert's matrix (+ its bias) -> [N, O], one matrix
    product per expert with rows (see the module docstring).  Differentiable in rows, weight and
    bias.

    Args:
        rows: [N, K] in the weight's dtype.
        weight: [E, O, K] (``F.linear`` layout), or [E, K, O] with ``transposed=True``.
        ends: E ints on the host, ends[e] = end of expert e's rows (read as their running maximum,
            clamped to [0, N]).
        transposed: the weight's layout.
        bias: [E, O], added to each expert's rows (converted to the rows' dtype first).
        zero_tail: False leaves the result rows past the last end, and their gradient,
            unspecified instead of zero (for callers that never read them: one launch fewer).
        offsets: the same ends as an [E] int32 tensor on the rows' device, where the caller has
            them: the bias gradient is then one launch of tutel's ``expert_row_sums`` instead of
            one sum per expert.
    """
    spans, last = expert_spans(ends, rows.shape[0])
    if bias is not None and bias.dtype != rows.dtype:
        bias = bias.to(rows.dtype)
    return _PerExpertMM.apply(rows, weight, bias, offsets if bias is not None else None, spans, last,
                              bool(transposed), bool(zero_tail))
