"""``quantized_grouped_linear`` as plain PyTorch operations, with the arguments and the result of
``torch.ops.tutel.quantized_grouped_linear``:

    out[r] = rows[r] @ W[e]^T + bias[e]   for expert e's rows r,

expert e's rows being ``rows[end[e-1]:end[e]]`` with ``end`` the running maximum of ``ends`` clamped
to [0, n] (as the CUDA kernel reads them), and the rows past the last end zeros.  Each expert with
rows has its matrix dequantized whole (decode_quantized_experts' decoding: each weight a float32
number, nvfp4's per-matrix scale applied to the products) and multiplied in float32, with one
rounding to the rows' dtype at the end; PyTorch sums in another order than the kernels, so the two
agree to rounding.  With ``activation_group`` g > 0 (W8A8) the rows are first quantized and
dequantized per row and group of g columns (tutel.quant.activations.dynamic_activations, the
operator's rule), then multiplied in float32.  The ends are read back to the host (one product
per expert), so this cannot be captured in a CUDA graph.
"""
from typing import List, Optional

import torch

from ...quant.activations import dynamic_activations
from .decode_quantized_experts import _product


def quantized_grouped_linear(rows: torch.Tensor, ends: torch.Tensor, format: str, codes: torch.Tensor,
                             scales: torch.Tensor, global_scale: Optional[torch.Tensor], block: List[int],
                             bias: Optional[torch.Tensor], activation_group: int = 0) -> torch.Tensor:
    """[n, N] in rows' dtype: each expert's rows times its dequantized matrix plus its bias (see the
    module docstring), as tutel::quantized_grouped_linear, whose checks the caller's arguments
    passed; zeros for the rows past the last end."""
    n, outputs = rows.shape[0], codes.shape[1]
    values = dynamic_activations(rows, activation_group, torch.float32) if activation_group > 0 and n else rows
    out = torch.zeros(n, outputs, dtype=torch.float32, device=rows.device)
    begin = 0
    for expert, value in enumerate(ends.tolist()):
        end = max(begin, min(max(int(value), 0), n))
        if end > begin:
            out[begin:end] = _product(values[begin:end].to(torch.float32), format, codes, scales, global_scale,
                                      list(block), bias, expert)
        begin = end
    return out.to(rows.dtype)
