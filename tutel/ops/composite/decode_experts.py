"""``decode_experts`` as plain PyTorch operations, with the arguments and the result of
``torch.ops.tutel.decode_experts``:

    out[t] = sum_j weights[t, j] * (unit(x[t] @ W_up[e]^T + b_up[e]) @ W_down[e]^T + b_down[e]),
    e = expert_ids[t, j],

over the choices whose id lies in [0, E), in the accumulation dtype (float32 for 16-bit data,
float64 for float64) with one rounding to x's dtype at the end, as the CUDA kernels compute it; the
products are PyTorch's, summed in another order, so the two agree to rounding.  One product per
chosen expert (each expert's matrices read once, for all the tokens that chose it), so this reads
the chosen experts back to the host: it cannot be captured in a CUDA graph.
"""
from typing import Optional

import torch

from .experts import _check_unit, _forward


def _projection(rows: torch.Tensor, matrix: torch.Tensor, transposed: bool) -> torch.Tensor:
    """rows @ matrix ([in, out], transposed) or rows @ matrix^T ([out, in]), in rows' dtype."""
    matrix = matrix.to(rows.dtype)
    return rows @ (matrix if transposed else matrix.t())


def _check(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor], up_weight: torch.Tensor,
           down_weight: torch.Tensor, transposed: bool, interleaved: bool, up_bias: Optional[torch.Tensor],
           gate_weight: Optional[torch.Tensor]) -> None:
    """The shape checks of csrc/ops/decode_experts_args.cpp, with its messages' content."""
    where = "tutel::decode_experts"
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: `x` must be a 2-D float32, float64, bfloat16 or float16 tensor, got {x.dtype} "
                         f"of shape {tuple(x.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64) or expert_ids.dim() != 2 or \
            expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: `expert_ids` must be int32 or int64 [T, k] with T = {x.shape[0]}, got "
                         f"{expert_ids.dtype} of shape {tuple(expert_ids.shape)}")
    if weights is not None and weights.shape != expert_ids.shape:
        raise ValueError(f"{where}: `weights` must have the shape of `expert_ids` {tuple(expert_ids.shape)}, got "
                         f"{tuple(weights.shape)}")
    for name, matrix in (("up_weight", up_weight), ("down_weight", down_weight), ("gate_weight", gate_weight)):
        if matrix is not None and (matrix.dim() != 3 or matrix.dtype != x.dtype):
            raise ValueError(f"{where}: `{name}` must be a 3-D tensor of x's dtype {x.dtype}, got {matrix.dtype} "
                             f"of shape {tuple(matrix.shape)}")
    if up_weight.shape[0] < 1 or down_weight.shape[0] != up_weight.shape[0]:
        raise ValueError(f"{where}: `up_weight` and `down_weight` must hold the same number (>= 1) of experts, got "
                         f"{up_weight.shape[0]} and {down_weight.shape[0]}")
    up_in, up_out = (up_weight.shape[1], up_weight.shape[2]) if transposed else (up_weight.shape[2],
                                                                                 up_weight.shape[1])
    inter = down_weight.shape[1] if transposed else down_weight.shape[2]
    if up_in != x.shape[1] or up_out != (inter if gate_weight is not None else 2 * inter):
        raise ValueError(f"{where}: `up_weight` {tuple(up_weight.shape)} does not fit x's {x.shape[1]} features and "
                         f"`down_weight`'s {inter} inputs (transposed={transposed})")
    if gate_weight is not None and (gate_weight.shape != up_weight.shape or interleaved or up_bias is not None):
        raise ValueError(f"{where}: `gate_weight` must have up_weight's shape {tuple(up_weight.shape)}, with a unit "
                         "that is not interleaved and no `up_bias`")


def decode_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                   up_weight: torch.Tensor, down_weight: torch.Tensor, up_bias: Optional[torch.Tensor],
                   down_bias: Optional[torch.Tensor], transposed: bool, alpha: float, up_offset: float,
                   limit: Optional[float], interleaved: bool, gate_weight: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
    """[T, O] in x's dtype: each token's weighted sum of its routed gated experts (see the module
    docstring), as tutel::decode_experts; zeros for a token without a kept choice."""
    _check(x, expert_ids, weights, up_weight, down_weight, transposed, interleaved, up_bias, gate_weight)
    _check_unit(alpha, up_offset, limit, "tutel::decode_experts")
    tokens, k = expert_ids.shape
    experts = up_weight.shape[0]
    outputs = down_weight.shape[2] if transposed else down_weight.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    ids = expert_ids.long()
    kept = (ids >= 0) & (ids < experts)
    # One row per choice (t, j), filled by its expert's rows, then summed over j: no float atomics.
    y = torch.zeros(tokens, k, outputs, dtype=acc, device=x.device)
    for e in torch.unique(ids[kept]).tolist():
        token, choice = (ids == e).nonzero(as_tuple=True)
        rows = x.index_select(0, token).to(acc)
        if gate_weight is None:
            gate_up = _projection(rows, up_weight[e], transposed)
            if up_bias is not None:
                gate_up = gate_up + up_bias[e].to(acc)
            gate, up = (gate_up[:, 0::2], gate_up[:, 1::2]) if interleaved else gate_up.chunk(2, dim=1)
        else:
            gate, up = _projection(rows, gate_weight[e], transposed), _projection(rows, up_weight[e], transposed)
        hidden = _forward(gate, up, alpha, up_offset, limit, acc)
        rows_out = _projection(hidden, down_weight[e], transposed)
        if down_bias is not None:
            rows_out = rows_out + down_bias[e].to(acc)
        if weights is not None:
            rows_out = rows_out * weights[token, choice].to(acc).unsqueeze(1)
        y[token, choice] = rows_out
    return y.sum(1).to(x.dtype)
