"""Per-expert matrix products from Python: the grouped layout's fallback where no grouped operator
runs (devices without tutel's compiled one and without a ``grouped_mm`` kernel for the operands)."""
from typing import Optional, Sequence

import torch


def _right_factor(weight: torch.Tensor, weight_transposed: bool) -> torch.Tensor:
    """The [.., K, O] matrices the rows are multiplied by."""
    return weight.transpose(-1, -2) if weight_transposed else weight


def _weight_grad(rows: torch.Tensor, grad: torch.Tensor, weight_transposed: bool) -> torch.Tensor:
    """d weight for rows [.., n, K] and output gradient [.., n, O], in the weight's layout."""
    if weight_transposed:
        return torch.matmul(grad.transpose(-1, -2), rows)
    return torch.matmul(rows.transpose(-1, -2), grad)


def grouped_linear_loop(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        group_rows: Sequence[int], weight_transposed: bool) -> torch.Tensor:
    """grouped_linear with one matrix product per expert from Python (devices without the
    compiled operator)."""
    out = x.new_empty((x.shape[0], weight.shape[1] if weight_transposed else weight.shape[2]))
    offset = 0
    for expert, count in enumerate(group_rows):
        if count:
            rows = x[offset:offset + count]
            right = _right_factor(weight[expert], weight_transposed)
            if bias is None:
                torch.mm(rows, right, out=out[offset:offset + count])
            else:
                torch.addmm(bias[expert], rows, right, out=out[offset:offset + count])
        offset += count
    return out


def grouped_linear_backward_loop(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_rows: Sequence[int],
                                 weight_transposed: bool, output_mask: Sequence[bool]):
    """grouped_linear_backward with one set of matrix products per expert from Python."""
    grad_x = torch.empty_like(x) if output_mask[0] else None
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if output_mask[1] else None
    grad_bias = grad.new_empty((weight.shape[0], grad.shape[1])) if output_mask[2] else None
    offset = 0
    for expert, count in enumerate(group_rows):
        rows_grad, rows = grad[offset:offset + count], x[offset:offset + count]
        if grad_x is not None and count:
            torch.mm(rows_grad, _right_factor(weight[expert], weight_transposed).t(), out=grad_x[offset:offset + count])
        if grad_weight is not None:
            grad_weight[expert] = _weight_grad(rows, rows_grad, weight_transposed) if count else 0
        if grad_bias is not None:
            grad_bias[expert] = rows_grad.sum(dim=0) if count else 0
        offset += count
    return grad_x, grad_weight, grad_bias
