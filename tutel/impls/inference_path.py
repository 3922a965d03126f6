"""moe_layer's forward without autograd at the sizes its experts run in one operator call: the
routing in one call of ``tutel._C.route_without_grad``, the experts in one of
``routed_gated_experts``.

The general forward builds Tutel's crit tuple (k lists of [T] tensors, the capacity, the counts),
normalizes the gates and computes the GShard loss in a dozen small PyTorch operators, then
rebuilds [k, T] tables from the lists for the experts.  Decoding one token, with the caches cold
after the other layers' weights streamed through them, those calls and the Python around them took
0.6 of the 1.9 ms of a DeepSeek-like bfloat16 layer.  Here the same steps run in C++ with the same
rounding (csrc/ops/cpu/routing_cpu.cpp); every call this path does not cover takes the general
forward.  tutel.rules.paths decides which calls come here (the rule LAYER_IN_TWO_CALLS).
"""
import torch
import torch.nn.functional as F

from .._extension import load_extension
from ..experts.routed import gated_experts_in_one_call
from ..ops.precision import gemm_dtype
from .call_context import CallContext, LayerResult
from .call_settings import CallSettings
from .layer_routing import gate_logits
from .static_grouped_path import planned_capacity


def forward_in_two_calls(layer, x: torch.Tensor, call: CallSettings) -> LayerResult:
    """The layer's result for the tokens x [T, M] (already in the compute dtype), for a call that
    tutel.rules.paths sends here (CPU inference, Tutel's routing, SwiGLU experts, the grouped
    layout, few enough rows for one operator call)."""
    tokens, num_experts, top_k = x.shape[0], layer.num_global_experts, call.top_k
    dtype = gemm_dtype(x.dtype, x.device, tokens * top_k / max(num_experts, 1))
    logits = gate_logits(layer, call.gate, x)
    scores = F.softmax(logits, dim=1)
    capacity = planned_capacity(layer, call, tokens)  # -1: dropless, nothing is dropped
    expert_ids, gates, dispatch_count, l_aux = _route_without_grad(
        scores, top_k, top_k > 1 and layer.normalize_gate, capacity, layer.batch_prioritized_routing)
    ctx = CallContext(layer, adaptive_degree=call.adaptive_r, a2a_ffn_overlap_degree=call.overlap,
                      megablocks_size=call.megablocks_size, dispatch_count=dispatch_count,
                      local_dispatch_count=dispatch_count)
    gate_w, up_w, down_w = layer.experts.gated_weights(ctx, dtype)
    y = gated_experts_in_one_call(x.to(dtype), expert_ids, gates, up_w, down_w, gate_weight=gate_w, transposed=True)
    return LayerResult(y.to(x.dtype), (y.shape[1],), l_aux, dispatch_count, gates.unbind(1), logits)


_route_without_grad = load_extension().route_without_grad
