"""Tutel 0.4.2's fast gating calls (``tutel.ops.qwen3_moe_scaled_topk``,
``deepseek_moe_sigmoid_scaled_topk``, ``kimi_moe_sigmoid_scaled_topk``) over tutel's own routing
operators: Qwen3-MoE's renormalised top-k over softmax probabilities (``route_topk``) and the
sigmoid routers of DeepSeek-V3 / Kimi-K2 (``route_experts``).

Tutel computes them with fixed-size kernels (k = 8, [T, 8] float32 weights and int32 ids, CUDA only);
here the same calls take any expert count, k (keyword ``top_k``, 8 by default), group setting and
scaling factor, run on every device, and never synchronise with the host: every size follows from
the input's shape.  Like Tutel's they return ``(weights, ids)``, both ``[T, k]`` with ``T`` the
product of the input's leading dims.  docs/routing.md ("Tutel's fast gating calls") has the maths.
"""
from typing import Optional, Tuple

import torch

from .checks import accumulation_dtype, require_finite_number, require_floating, require_tensor, require_top_k
from .route_experts import _check_groups, _routed
from .routing import route_topk_unchecked

# The routers of the models the calls are named after (their configs' values).
DEEPSEEK_V3_GROUPS = (8, 4)              # n_group, topk_group (256 experts in 8 groups of 32)
DEEPSEEK_V3_SCALING = 2.5                # routed_scaling_factor
KIMI_K2_GROUPS = (1, 1)                  # one group: no group limit (384 experts)
KIMI_K2_SCALING = 2.827
TUTEL_TOP_K = 8                          # Tutel's kernels choose 8 experts per token


def _token_rows(scores: torch.Tensor, name: str, where: str) -> torch.Tensor:
    """`scores` [..., E] as [T, E] (Tutel views its input as numel / E rows of E experts)."""
    require_floating(scores, name, where)
    if scores.dim() < 1 or scores.shape[-1] < 1:
        raise ValueError(f"{where}: `{name}` must have at least 1 dimension with the experts last (E >= 1), got "
                         f"shape {tuple(scores.shape)}")
    return scores.reshape(-1, scores.shape[-1])


def _buffer_rows(out: Optional[torch.Tensor], tokens: int, k: int, dtype: torch.dtype, device: torch.device,
                 name: str, where: str) -> Optional[torch.Tensor]:
    """A caller's output buffer viewed as [T, width >= k] (Tutel's kernels view theirs as [T, -1] and
    write its first k columns; the others keep their values), checked before anything is written."""
    if out is None:
        return None
    require_tensor(out, name, where)
    if out.dtype != dtype:
        raise TypeError(f"{where}: `{name}` must be {dtype} (the dtype of the result it receives), got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{where}: `{name}` is on {out.device} but the logits are on {device}")
    if not out.is_contiguous():
        raise ValueError(f"{where}: `{name}` must be contiguous (it is viewed as [tokens, -1]), got strides "
                         f"{out.stride()} for shape {tuple(out.shape)}")
    width = out.numel() // tokens if tokens else k
    if out.numel() != tokens * width or width < k:
        raise ValueError(f"{where}: `{name}` of shape {tuple(out.shape)} does not hold {tokens} rows of at least "
                         f"k={k} entries; allowed: numel = {tokens} * width with width >= {k}")
    return out.view(tokens, width)


def _into(rows: Optional[torch.Tensor], result: torch.Tensor) -> torch.Tensor:
    """`result` [T, k] in the first k columns of the buffer `rows` (then the buffer), or `result`."""
    if rows is None:
        return result
    rows[:, :result.shape[1]].copy_(result)
    return rows


def qwen3_moe_scaled_topk(router_probs: torch.Tensor, *, top_k: int = TUTEL_TOP_K
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's routing from its softmax probabilities, as Tutel's ``ops.qwen3_moe_scaled_topk``.

    Args:
        router_probs: [..., E] probabilities (``softmax(logits, -1, dtype=torch.float32)`` in Tutel's
            and transformers' Qwen3-MoE); float32 (Tutel's only dtype), float64, bfloat16 or float16.
        top_k: experts per token, 1 <= top_k <= E (Tutel: 8).

    Returns:
        (weights [T, top_k], ids [T, top_k] int32), T = router_probs.numel() / E: the top_k largest
        probabilities p (best first; equal values: the lower expert id) divided by their sum (Qwen3's
        ``norm_topk_prob``), so each row sums to 1.  Weights are float32 (float64 for float64 input)
        and carry gradients to `router_probs`.
    """
    where = "tutel.ops.qwen3_moe_scaled_topk"
    probs = _token_rows(router_probs, "router_probs", where)
    top_k = require_top_k(top_k, probs.shape[1], where)
    routing = route_topk_unchecked(probs, top_k, False)
    chosen = routing.gates.to(accumulation_dtype(probs.dtype))                      # [k, T]
    weights = chosen / chosen.sum(dim=0, keepdim=True).clamp_min(torch.finfo(chosen.dtype).tiny)  # 0/0 -> 0
    return weights.t().contiguous(), routing.indices.t().contiguous()


def _sigmoid_scaled_topk(where: str, logits: torch.Tensor, correction_bias: Optional[torch.Tensor],
                         top_v_out: Optional[torch.Tensor], top_k_out: Optional[torch.Tensor], top_k: int,
                         n_group: Optional[int], topk_group: Optional[int], routed_scaling_factor: float
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc router on tutel.ops.route_experts (see deepseek_moe_sigmoid_scaled_topk)."""
    rows = _token_rows(logits, "logits", where)
    num_experts = rows.shape[1]
    top_k = require_top_k(top_k, num_experts, where)
    n_group, topk_group = _check_groups(n_group, topk_group, top_k, num_experts, where)
    if n_group == topk_group:  # every group kept: the limit chooses nothing (Kimi-K2's single group)
        n_group = topk_group = 0
    scaling = require_finite_number(routed_scaling_factor, "routed_scaling_factor", where)
    # Chosen and weighted in float32 (float64 for float64 logits), as transformers' router (float32
    # logits and bias) and Tutel's kernels (bfloat16 in, float32 out) do.
    rows = rows.to(accumulation_dtype(rows.dtype))
    bias = None
    if correction_bias is not None:
        require_floating(correction_bias, "correction_bias", where)
        if tuple(correction_bias.shape) != (num_experts,):
            raise ValueError(f"{where}: `correction_bias` must have shape [num_experts] = [{num_experts}], got "
                             f"{tuple(correction_bias.shape)}")
        if correction_bias.device != rows.device:
            raise ValueError(f"{where}: `correction_bias` is on {correction_bias.device} but the logits are on "
                             f"{rows.device}")
        bias = correction_bias.detach().to(rows.dtype)  # steers the choice only: no gradient
    weights_out = _buffer_rows(top_v_out, rows.shape[0], top_k, rows.dtype, rows.device, "top_v_out", where)
    ids_out = _buffer_rows(top_k_out, rows.shape[0], top_k, torch.int32, rows.device, "top_k_out", where)
    routing = _routed(rows, top_k, "sigmoid", False, bias, n_group, topk_group, True, float(scaling), False, -1,
                      False)
    return _into(weights_out, routing.weights.t().contiguous()), _into(ids_out, routing.expert_ids.t().contiguous())


def deepseek_moe_sigmoid_scaled_topk(logits: torch.Tensor, correction_bias: Optional[torch.Tensor],
                                     top_v_out: Optional[torch.Tensor] = None,
                                     top_k_out: Optional[torch.Tensor] = None, *, top_k: int = TUTEL_TOP_K,
                                     n_group: Optional[int] = DEEPSEEK_V3_GROUPS[0],
                                     topk_group: Optional[int] = DEEPSEEK_V3_GROUPS[1],
                                     routed_scaling_factor: float = DEEPSEEK_V3_SCALING
                                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / R1's routing from the gate's logits, as Tutel's ``ops.deepseek_moe_sigmoid_scaled_topk``.

    With z the logits and b the correction bias (``e_score_correction_bias``), per token:
    s = sigmoid(z); c = s + b; the E experts form `n_group` consecutive groups, each scored by the
    sum of its two largest c, and only the `topk_group` best groups stay (c = -inf elsewhere);
    ids = the `top_k` experts with the largest c (best first; ties: the lower expert, the lower
    group); weights = s[ids] / sum(s[ids]) * `routed_scaling_factor` (the bias never enters them).
    Computed in float32 (float64 for float64 logits).

    Args:
        logits: [..., E] gate logits; bfloat16 (Tutel's only dtype), float32, float64 or float16.
        correction_bias: [E] floating bias for the choice (no gradient); None: no bias.
        top_v_out, top_k_out: optional buffers (Tutel's in-place outputs): contiguous, T * width
            entries with width >= top_k, of the weights' dtype (float32; float64 for float64 logits)
            and int32; the results fill their first top_k columns viewed as [T, width], the other
            columns keep their values, and the views are returned.
        top_k, n_group, topk_group, routed_scaling_factor: DeepSeek-V3's config (8, 8, 4, 2.5) by
            default; n_group = topk_group = None routes without a group limit.

    Returns:
        (weights [T, top_k], ids [T, top_k] int32), T = logits.numel() / E; the weights carry
        gradients to `logits`.
    """
    return _sigmoid_scaled_topk("tutel.ops.deepseek_moe_sigmoid_scaled_topk", logits, correction_bias, top_v_out,
                                top_k_out, top_k, n_group, topk_group, routed_scaling_factor)


def kimi_moe_sigmoid_scaled_topk(logits: torch.Tensor, correction_bias: Optional[torch.Tensor],
                                 top_v_out: Optional[torch.Tensor] = None, top_k_out: Optional[torch.Tensor] = None,
                                 *, top_k: int = TUTEL_TOP_K, routed_scaling_factor: float = KIMI_K2_SCALING
                                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Kimi-K2's routing from the gate's logits, as Tutel's ``ops.kimi_moe_sigmoid_scaled_topk``.

    DeepSeek-V3's router (``deepseek_moe_sigmoid_scaled_topk``) with Kimi-K2's config: one group (no
    group limit), top_k = 8 and routed_scaling_factor = 2.827 by default: s = sigmoid(z), ids = the
    top_k largest s + b, weights = s[ids] / sum(s[ids]) * routed_scaling_factor.  Arguments, buffers
    and results as there.
    """
    return _sigmoid_scaled_topk("tutel.ops.kimi_moe_sigmoid_scaled_topk", logits, correction_bias, top_v_out,
                                top_k_out, top_k, *KIMI_K2_GROUPS, routed_scaling_factor)

