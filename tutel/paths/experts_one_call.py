"""Experts stage for CPU inference of gated experts at decoding sizes: tutel's
``routed_gated_experts`` operator groups the choices, runs both products and the gated unit and
combines the outputs in one call."""
from typing import Optional

import torch

from ..ops import direct
from ..ops.gated_units import SWIGLU, GatedUnit, unit_scalars
from ..ops.tracing import direct_call_allowed
from .work import Work

def gated_experts_in_one_call(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                              up_weight: torch.Tensor, down_weight: torch.Tensor, *,
                              gate_weight: Optional[torch.Tensor] = None, up_bias: Optional[torch.Tensor] = None,
                              down_bias: Optional[torch.Tensor] = None, transposed: bool = False,
                              unit: GatedUnit = SWIGLU) -> torch.Tensor:
    """routed_experts' result for gated experts on CPU without autograd, in one call of tutel's
    ``routed_gated_experts`` operator: grouping, both products, the gated unit and the weighted
    combine, without an operator call and its Python around each.

    Args:
        x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, transposed: as for
            tutel.experts.routed_experts, every tensor on the CPU and the floating ones in x's dtype
            (biases are converted); nothing may require a gradient.
        gate_weight: the gates' own matrices, of up_weight's shape (then up_weight holds the ups
            only, as in moe_layer's llama_ffn), or None for up_weight's [gate | up] halves.
        unit: the gated unit (not interleaved with gate_weight), checked by the caller
            (tutel.ops.gated_units.check_unit: routed_experts and transformers' experts check theirs
            once, moe_layer's is SwiGLU).

    Returns:
        [T, O] in x's dtype."""
    if up_bias is not None:
        up_bias = up_bias.to(x.dtype)
    if down_bias is not None:
        down_bias = down_bias.to(x.dtype)
    tensors = (x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias)
    # The CPU implementation bound directly where the dispatcher has nothing to do (plain tensors):
    # with the caches cold it costs as much as the operator's own fixed work at decoding sizes.
    operator = direct.routed_gated_experts_cpu if direct_call_allowed(*tensors, gate_weight) \
        else direct.routed_gated_experts
    return operator(*tensors, bool(transposed), *unit_scalars(unit), bool(unit.interleaved), gate_weight)


def one_call(work: Work) -> None:
    """routed_gated_experts on the [T, k] choices, in the products' dtype: the combined [T, O] result."""
    g = work.experts.gated(work.dtype)
    work.y = gated_experts_in_one_call(work.x.to(work.dtype), work.expert_ids, work.weights, g.up_weight,
                                       g.down_weight, gate_weight=g.gate_weight, up_bias=g.up_bias,
                                       down_bias=g.down_bias, transposed=g.transposed, unit=g.unit)
    work.features = (work.y.shape[1],)
