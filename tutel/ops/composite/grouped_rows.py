"""``grouped_rows_linear`` and its backward as plain PyTorch operations, with the arguments and
results of ``torch.ops.tutel``'s: rows [N, K] grouped by expert (``offsets`` [E] int32, the
non-decreasing end of each expert's rows), out[i] = rows[i] @ W_e^T + b_e (weight [E, O, K]) or
rows[i] @ W_e + b_e (``transposed``: [E, K, O]); zeros for the rows past ``offsets[E - 1]``.

One matrix product per expert, so this one reads the group ends back to the host: no PyTorch
operator multiplies groups of rows by their own matrices without the groups' sizes on the host
(``torch.nn.functional.grouped_mm`` does where it has a kernel for the operands, and
``tutel.ops.grouped_mm`` takes it first).  It cannot be captured in a CUDA graph; the compiled
operator (kernels/grouped_rows_gemm.cu on CUDA) can.  The products are PyTorch's, summed in
another order than the kernels', so the two agree to rounding.
"""
from typing import List, Optional, Sequence, Tuple

import torch

from .._expert_loops import grouped_linear_backward_loop, grouped_linear_loop
from .expert_rows import check_rows
from .experts import check_offsets


def _check(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transposed: bool,
           where: str) -> Tuple[int, int]:
    """The checks of csrc/ops/grouped_rows_args.cpp; returns (K, O)."""
    check_rows(rows, "rows", where)
    if weight.dim() != 3:
        raise ValueError(f"{where}: `weight` must be 3-D, got shape {tuple(weight.shape)}")
    if weight.dtype != rows.dtype:
        raise TypeError(f"{where}: `weight` must have dtype {rows.dtype}, got {weight.dtype}")
    if weight.device != rows.device:
        raise ValueError(f"{where}: `weight` is on {weight.device} but the data is on {rows.device}")
    depth, outputs = (weight.shape[1], weight.shape[2]) if transposed else (weight.shape[2], weight.shape[1])
    if weight.shape[0] < 1:
        raise ValueError(f"{where}: `weight` must hold at least one expert, got shape {tuple(weight.shape)}")
    if depth != rows.shape[1]:
        layout = "[E, K, O]" if transposed else "[E, O, K]"
        raise ValueError(f"{where}: `weight` {tuple(weight.shape)} ({layout}) must take the {rows.shape[1]} features "
                         "of `rows`")
    check_offsets(offsets, rows, where)
    if offsets.shape[0] != weight.shape[0]:
        raise ValueError(f"{where}: `offsets` must have one end per expert ([{weight.shape[0]}]), got shape "
                         f"{tuple(offsets.shape)}")
    return depth, outputs


def _group_rows(offsets: torch.Tensor, rows: int, where: str) -> List[int]:
    """Rows per expert; ValueError unless the ends are non-decreasing within [0, rows]."""
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    for expert, (start, end) in enumerate(zip(starts, ends)):
        if not start <= end <= rows:
            raise ValueError(f"{where}: `offsets` must be non-decreasing ends of the experts' rows within [0, N = "
                             f"{rows}], got offsets[{expert}] = {end}" + (f" after {start}" if expert else ""))
    return [end - start for start, end in zip(starts, ends)]


def grouped_rows_linear(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    """[N, O]: each expert's rows times its matrix plus its bias, zeros past the last end; as
    tutel::grouped_rows_linear."""
    where = "tutel::grouped_rows_linear"
    _, outputs = _check(rows, weight, offsets, transposed, where)
    if bias is not None:
        if bias.dtype != rows.dtype:
            raise TypeError(f"{where}: `bias` must have dtype {rows.dtype}, got {bias.dtype}")
        if tuple(bias.shape) != (weight.shape[0], outputs):
            raise ValueError(f"{where}: `bias` must have shape [E, O] = [{weight.shape[0]}, {outputs}], got "
                             f"{tuple(bias.shape)}")
    counts = _group_rows(offsets, rows.shape[0], where)
    kept = sum(counts)
    out = rows.new_zeros((rows.shape[0], outputs))
    if kept:  # grouped_linear_loop's flag says the matrices are [O, K]
        out[:kept] = grouped_linear_loop(rows[:kept], weight, bias, counts, not transposed)
    return out


def grouped_rows_linear_backward(grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                                 transposed: bool, output_mask: Sequence[bool]
                                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of rows (zero past the last end), weight and bias; those not in output_mask
    empty; as tutel::grouped_rows_linear_backward."""
    where = "tutel::grouped_rows_linear_backward"
    depth, outputs = _check(rows, weight, offsets, transposed, where)
    if grad.dtype != rows.dtype or tuple(grad.shape) != (rows.shape[0], outputs):
        raise ValueError(f"{where}: `grad` must be [N, O] = [{rows.shape[0]}, {outputs}] of dtype {rows.dtype}, got "
                         f"{tuple(grad.shape)} {grad.dtype}")
    counts = _group_rows(offsets, rows.shape[0], where)
    kept = sum(counts)
    grad_rows, grad_weight, grad_bias = grouped_linear_backward_loop(grad[:kept], rows[:kept], weight, counts,
                                                                     not transposed, list(output_mask))
    empty = rows.new_empty
    if output_mask[0]:
        grad_rows = torch.cat([grad_rows, rows.new_zeros((rows.shape[0] - kept, depth))])
    return (grad_rows if output_mask[0] else empty((0, depth)),
            grad_weight if output_mask[1] else empty((0,)),
            grad_bias if output_mask[2] else empty((0, outputs)))
