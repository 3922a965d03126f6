"""moe_layer's forward with every size fixed by the shapes: the path a CUDA graph captures.

The routing (tutel.ops.route_experts: top-k, weights, GShard slots, the grouped plan and the loss,
two launches on CUDA) plans one grouped buffer of static size: T * k rows when the call is
dropless, E * capacity with a static capacity.  The kept choices are copied into it sorted by
expert, the experts' grouped products (``grouped_products`` of the built-in experts) run over it
with the per-expert ends kept on the device, and the weighted combine brings the rows back in token
order.  No size is read back to the host, so the forward and backward trace on fake tensors and
are captured by CUDA graphs, dropless included (the padded path must read the largest load to size
its [E, C, M] buffer).  Dropless inference at decoding sizes with SwiGLU experts skips the buffer:
the decode kernels (tutel.ops.decode_experts) take the routing's [k, T] tables as they are.
tutel.rules.paths decides which calls come here (the rules STATIC_DECODE and STATIC_GROUPED).
"""
from typing import Tuple

import torch

from .. import ops
from ..experts.routed import RoutingPlan
from ..ops.decode_experts import decode_experts
from ..ops.route_experts import ExpertRouting, route_experts
from ..rules.autocast import without_autocast
from ..rules.capacity import capacity_alignment, expert_capacity
from .call_context import CallContext, LayerResult
from .call_settings import CallSettings
from .layer_routing import gate_logits

DROPLESS = -1


def planned_capacity(layer, call: CallSettings, tokens: int) -> int:
    """The call's static capacity per expert, or DROPLESS (-1) for capacity_factor = 0: both follow
    from the shapes alone (a negative capacity_factor, capped at the largest load, does not)."""
    if call.capacity_factor == 0:
        return DROPLESS
    alignment = capacity_alignment(layer.sharded_count, call.overlap, call.megablocks_size)
    return expert_capacity(call.capacity_factor, call.top_k, tokens, layer.num_global_experts, alignment=alignment)


def _route(layer, x: torch.Tensor, call: CallSettings, capacity: int) -> Tuple[torch.Tensor, ExpertRouting]:
    """The gate's logits and Tutel's routing of them (top-k, weights, slots, plan and GShard loss)."""
    with without_autocast(x.device.type):
        logits = gate_logits(layer, call.gate, x)
    top_k = call.top_k
    return logits, route_experts(logits, top_k, renormalize=top_k > 1 and layer.normalize_gate,
                                 batch_prioritized=layer.batch_prioritized_routing, capacity=capacity, with_loss=True)


def _context(layer, call: CallSettings, routing: ExpertRouting) -> CallContext:
    return CallContext(layer, adaptive_degree=call.adaptive_r, a2a_ffn_overlap_degree=call.overlap,
                       megablocks_size=call.megablocks_size, dispatch_count=routing.dispatch_count,
                       local_dispatch_count=routing.dispatch_count)


def forward_static_decode(layer, x: torch.Tensor, call: CallSettings) -> LayerResult:
    """The layer's result for the tokens x [T, M] (in the compute dtype) of a dropless inference call
    at decoding sizes with SwiGLU experts (the rule STATIC_DECODE): the routing, then the decode
    kernels, which read each chosen expert's matrices once (tutel.ops.decode_experts)."""
    logits, routing = _route(layer, x, call, DROPLESS)
    gate_w, up_w, down_w = layer.experts.gated_weights(_context(layer, call, routing), x.dtype)
    y = decode_experts(x, routing.expert_ids.t(), routing.weights.t(), up_w, down_w, gate_weight=gate_w,
                       transposed=True)
    return LayerResult(y, (y.shape[1],), routing.l_aux, routing.dispatch_count, routing.weights.unbind(0), logits)


def forward_static_grouped(layer, x: torch.Tensor, call: CallSettings) -> LayerResult:
    """The layer's result for the tokens x [T, M] (in the compute dtype), for a call that
    tutel.rules.paths sends here (one process, Tutel's routing, a static or dropless capacity,
    experts that offer grouped products); differentiable like the padded path."""
    logits, routing = _route(layer, x, call, planned_capacity(layer, call, x.shape[0]))
    rows = routing.row_choices.shape[0]  # T * k, or E * capacity
    ctx = _context(layer, call, routing)
    run, _ = layer.experts.grouped_products(ctx, x.dtype)
    # The grouped buffer is one "expert" of `rows` slots (indices None: every choice's expert is 0),
    # each slot named by at most one choice; the experts read the ends only.
    indices = None
    plan = RoutingPlan(indices, routing.grouped_locations, None, None, routing.dispatch_count, routing.ends)
    weights = routing.weights  # in the accumulation dtype the combine takes: no conversion
    at_combine = layer.is_postscore
    grouped = ops.encode(x, indices, routing.grouped_locations, 1, rows, gates=None if at_combine else weights)
    out = run(grouped.view(rows, x.shape[1]), plan)
    y = ops.decode(out.view(1, rows, out.shape[-1]), indices, routing.grouped_locations,
                   gates=weights if at_combine else None)
    return LayerResult(y, (out.shape[-1],), routing.l_aux, routing.dispatch_count, routing.weights.unbind(0), logits)
