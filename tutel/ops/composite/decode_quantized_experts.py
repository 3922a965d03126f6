"""``decode_quantized_experts`` as plain PyTorch operations, with the arguments and the result of
``torch.ops.tutel.decode_quantized_experts`` (the formats: tutel.ops.decode_quantized_experts):

    out[t] = sum_j weights[t, j] * (unit(x[t] @ Wgu[e]^T + gate_up_bias[e]) @ Wd[e]^T + down_bias[e]),
    e = expert_ids[t, j],

over the choices whose id lies in [0, E).  Each chosen expert's matrices are dequantized whole
(tutel.quant.codes' decoders, from the formats' bit layouts; each weight is a float32 number, as
the kernels decode it, nvfp4's per-matrix scale applied to the products) and multiplied in
float32, the unit's values rounded to x's dtype between the products and the sum once at the
end; the products are PyTorch's, summed in another
order than the kernels', so the two agree to rounding.  One product per chosen expert, so this
reads the chosen experts back to the host: it cannot be captured in a CUDA graph.
"""
import math
from typing import List, Optional

import torch

from ...quant.codes import decode_e2m1, decode_e4m3fn, decode_e8m0, unpack_e2m1
from .experts import _forward


def _dequantized(format: str, codes: torch.Tensor, scales: torch.Tensor, block: List[int], expert: int) -> torch.Tensor:
    """Expert `expert`'s matrix [N, K] in float32 (without nvfp4's per-matrix scale)."""
    if format == "fp8_block":
        values = decode_e4m3fn(codes[expert])
        rows, cols = values.shape
        scale = scales[expert].to(torch.float64)
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    else:
        values = decode_e2m1(unpack_e2m1(codes[expert]))
        if format == "mxfp4":
            scale = decode_e8m0(scales[expert]).repeat_interleave(32, 1)
        else:
            scale = decode_e4m3fn(scales[expert]).repeat_interleave(16, 1)
    # Code times scale rounded once to float32, as the kernels' product of two float32 numbers.
    return (values * scale).to(torch.float32)


def _product(rows: torch.Tensor, format: str, codes: torch.Tensor, scales: torch.Tensor,
             global_scale: Optional[torch.Tensor], block: List[int], bias: Optional[torch.Tensor],
             expert: int) -> torch.Tensor:
    """rows @ W[expert]^T (times nvfp4's scale) plus the bias, in float32."""
    out = rows @ _dequantized(format, codes, scales, block, expert).t()
    if global_scale is not None:
        out = out * global_scale[expert].to(torch.float32)
    if bias is not None:
        out = out + bias[expert].to(torch.float32)
    return out


def _unit(gate_up: torch.Tensor, activation: str, alpha: float, up_offset: float, limit: Optional[float],
          interleaved: bool) -> torch.Tensor:
    if activation == "gated":
        gate, up = (gate_up[:, 0::2], gate_up[:, 1::2]) if interleaved else gate_up.chunk(2, dim=1)
        return _forward(gate, up, alpha, up_offset, limit, torch.float32)
    if activation == "relu":
        return torch.where((gate_up > 0) | gate_up.isnan(), gate_up, torch.zeros_like(gate_up))  # NaN stays NaN
    if activation == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (gate_up + 0.044715 * gate_up * gate_up * gate_up)
        return 0.5 * gate_up * (1.0 + torch.tanh(inner))
    return 0.5 * gate_up * (1.0 + torch.erf(gate_up * (1.0 / math.sqrt(2.0))))


def decode_quantized_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor], format: str,
                             gate_up: torch.Tensor, gate_up_scales: torch.Tensor,
                             gate_up_global: Optional[torch.Tensor], down: torch.Tensor, down_scales: torch.Tensor,
                             down_global: Optional[torch.Tensor], block: List[int],
                             gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                             activation: str, alpha: float, up_offset: float, limit: Optional[float],
                             interleaved: bool) -> torch.Tensor:
    """[T, O] in x's dtype: each token's weighted sum of its routed experts (see the module
    docstring), as tutel::decode_quantized_experts, whose checks the caller's arguments passed
    (tutel.ops.decode_quantized_experts); zeros for a token without a kept choice."""
    tokens, k = expert_ids.shape
    experts, outputs = gate_up.shape[0], down.shape[1]
    ids = expert_ids.long()
    kept = (ids >= 0) & (ids < experts)
    # One row per choice (t, j), filled by its expert's rows, then summed over j.
    y = torch.zeros(tokens, k, outputs, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids[kept]).tolist():
        token, choice = (ids == e).nonzero(as_tuple=True)
        rows = x.index_select(0, token).to(torch.float32)
        hidden = _unit(_product(rows, format, gate_up, gate_up_scales, gate_up_global, block, gate_up_bias, e),
                       activation, alpha, up_offset, limit, interleaved).to(x.dtype).to(torch.float32)
        rows_out = _product(hidden, format, down, down_scales, down_global, block, down_bias, e)
        if weights is not None:
            rows_out = rows_out * weights[token, choice].to(torch.float32).unsqueeze(1)
        y[token, choice] = rows_out
    return y.sum(1).to(x.dtype)
