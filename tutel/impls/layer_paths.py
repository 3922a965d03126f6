"""moe_layer's execution paths: the facts of a call, and one function per path.

``layer_facts`` describes a call for ``tutel.rules.paths.choose_path``; ``run_path`` runs the path
it names.  Every path returns what it computed (a ``LayerResult``: the output, the loss, the
counts, the routing weights and the gate's logits); none leaves results on the layer, and the
experts get this call's switches through a ``CallContext``.
"""
import math
from typing import Callable, Dict, Sequence

import torch

from .. import ops
from ..experts._grouped import choice_table, grouped_locations, occupied_rows
from ..experts.routed import combine_without_grad, fits_one_call, gated_experts_in_one_call, piece_rows, plan_routing
from ..ops.decode_experts import decode_experts_supported
from ..ops.precision import gemm_dtype
from ..ops.tracing import direct_call_allowed, is_compiling
from ..rules.autocast import autocast_dtype
from ..rules.paths import LAYER, Path, PathChoice, choose_path
from . import inference_path
from .call_agreement import agree_on_call
from .call_context import CallContext, LayerResult
from .call_settings import CallSettings
from .fast_dispatch import fast_decode, fast_encode
from .layer_routing import Routing, route_call, uses_tutel_routing
from .static_grouped_path import forward_static_decode, forward_static_grouped


def _device_kind(x: torch.Tensor) -> str:
    kind = x.device.type
    return kind if kind in ("cpu", "cuda") else "other"


def records_gradient(layer, x: torch.Tensor) -> bool:
    """Whether autograd records this call: grad mode on and the tokens or a parameter require grad."""
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p.requires_grad for p in layer.parameters())


def layer_facts(layer, x: torch.Tensor, call: CallSettings, reserve_dims: int) -> Dict[str, object]:
    """The facts of a call of `layer` on tokens x [T, M] (tutel.rules.paths.FACTS)."""
    experts = layer.experts
    if call.capacity_factor > 0:
        capacity = "static"
    else:
        capacity = "dropless" if call.capacity_factor == 0 else "capped"
    return {
        "device": _device_kind(x),
        "gradient": records_gradient(layer, x),
        "plain": not is_compiling() and direct_call_allowed(x),
        "traced": is_compiling(),
        "autocast": autocast_dtype(x.device.type) is not None,
        "processes": "several" if layer.world_size > 1 else "one",
        "layout": "grouped" if call.megablocks_size > 0 else "padded",
        "capacity": capacity,
        "tutel_routing": uses_tutel_routing(layer, call.gate),
        "gate_at_combine": layer.is_postscore,
        "token_dims": "one" if reserve_dims == 1 else "several",
        "gated_experts": bool(getattr(experts, "offers_gated_weights", False)),
        "experts_in_pieces": bool(getattr(experts, "offers_grouped_products", False)),
        "experts_grouped": callable(getattr(experts, "forward_grouped", None)),
        "rows_fit_one_call": fits_one_call(x.shape[0] * call.top_k),
        "decode_kernel": decode_experts_supported(x.shape[0], call.top_k, x.dtype, x.device,
                                                  experts=layer.num_global_experts),
    }


def choose_layer_path(layer, x: torch.Tensor, call: CallSettings, reserve_dims: int) -> PathChoice:
    """The path of a call of `layer` on tokens x [T, M], with the reason."""
    return choose_path(LAYER, layer_facts(layer, x, call, reserve_dims))


def run_path(path: Path, layer, x: torch.Tensor, call: CallSettings, reserve_shape: Sequence[int],
             sequence_length: int, inequivalent_tokens: bool) -> LayerResult:
    """Runs `path` for tokens x [T, M] (in the compute dtype)."""
    if path is Path.LAYER_IN_TWO_CALLS:
        return inference_path.forward_in_two_calls(layer, x, call)
    if path is Path.STATIC_GROUPED:
        return forward_static_grouped(layer, x, call)
    if path is Path.STATIC_DECODE:
        return forward_static_decode(layer, x, call)
    routing = route_call(layer, x, call, sequence_length, inequivalent_tokens)
    return _ROUTED_PATHS[path](layer, x, call, routing, reserve_shape)


def _context(layer, call: CallSettings, routing: Routing) -> CallContext:
    dispatch_count = routing.crit.dispatch_count
    return CallContext(layer, adaptive_degree=call.adaptive_r, a2a_ffn_overlap_degree=call.overlap,
                       megablocks_size=call.megablocks_size, dispatch_count=dispatch_count,
                       local_dispatch_count=dispatch_count)


def _result(y: torch.Tensor, features, routing: Routing, crit=None) -> LayerResult:
    crit = routing.crit if crit is None else crit
    return LayerResult(y, tuple(features), routing.l_aux, crit.dispatch_count, crit.gates_s, routing.logits)


def _kept_expert_ids(crit, dropless: bool) -> torch.Tensor:
    """[k, T] expert ids of crit with the dropped choices (past the capacity, or Tutel's negative
    "not dispatched" index) given the id E, which the grouped operators skip."""
    num_experts, indices_s, locations_s, _, capacity, *_ = crit  # not crit[:5]: PyTorch 2.6's torch.compile fails on it
    indices = choice_table(indices_s)
    # Nothing is dropped when the call is dropless (the capacity is the largest load) or the
    # capacity reaches T (an expert receives at most T choices).
    if dropless or capacity >= indices.shape[1]:
        return indices
    locations = choice_table(locations_s)
    kept = (locations < capacity) & (indices >= 0)
    return torch.where(kept, indices, torch.full_like(indices, num_experts))


def _grouped_one_call(layer, x, call, routing, reserve_shape) -> LayerResult:
    """CPU inference, SwiGLU experts: grouping, experts and combine in one operator call."""
    crit = routing.crit
    expert_ids = _kept_expert_ids(crit, call.capacity_factor == 0)
    dtype = gemm_dtype(x.dtype, x.device, expert_ids.numel() / max(layer.num_global_experts, 1))
    gate_w, up_w, down_w = layer.experts.gated_weights(_context(layer, call, routing), dtype)
    y = gated_experts_in_one_call(x.to(dtype), expert_ids.t(), choice_table(crit.gates_s).t(), up_w, down_w,
                                  gate_weight=gate_w, transposed=True)
    return _result(y.to(x.dtype), y.shape[1:], routing)


def _grouped_pieces(layer, x, call, routing, reserve_shape) -> LayerResult:
    """CPU inference on the grouped layout: the kept rows through the experts' grouped products in
    pieces (tutel.experts.routed.combine_without_grad); the blocks' padding rows are not computed."""
    crit = routing.crit
    expert_ids = _kept_expert_ids(crit, call.capacity_factor == 0)
    num_experts = layer.num_global_experts
    dtype = gemm_dtype(x.dtype, x.device, expert_ids.numel() / max(num_experts, 1))
    run, row_bytes = layer.experts.grouped_products(_context(layer, call, routing), dtype)
    y = combine_without_grad(x.to(dtype), choice_table(crit.gates_s).t(), plan_routing(expert_ids.t(), num_experts),
                             run, piece_rows(row_bytes))
    return _result(y.to(x.dtype), y.shape[1:], routing)


def _grouped(layer, x, call, routing, reserve_shape) -> LayerResult:
    """megablocks_size > 0: the tokens go straight into the experts' occupied rows (each expert's load
    rounded up to the block), through autograd; reads the loads on the host (the shapes need them)."""
    crit = routing.crit
    gates = crit.gates_s if not layer.is_postscore else None
    rows = occupied_rows(crit.dispatch_count, crit.capacity, call.megablocks_size)
    indices, locations, total = grouped_locations(crit, rows)
    grouped = ops.encode(x, indices, locations, 1, total, gates=gates)
    y = layer.experts.forward_grouped(grouped.view(total, *reserve_shape), rows, _context(layer, call, routing))
    features = y.shape[1:]
    y = ops.decode(y.reshape(1, total, math.prod(features)), indices, locations,
                   gates=crit.gates_s if layer.is_postscore else None)
    return _result(y, features, routing)


def _padded(layer, x, call, routing, reserve_shape) -> LayerResult:
    """Tutel's path: encode into [E, C, M], the experts module, decode."""
    ctx = _context(layer, call, routing)
    y = fast_encode(x, routing.crit, layer.is_postscore)
    y = layer.run_local_experts(y, reserve_shape, ctx)
    features = y.shape[2:]
    y = fast_decode(y.reshape(y.size(0), y.size(1), math.prod(features)), routing.crit, layer.is_postscore)
    return _result(y, features, routing)


def _expert_parallel(layer, x, call, routing, reserve_shape) -> LayerResult:
    """Several processes: every process agrees on the capacity, then each expert's slots travel to
    its process and back (tutel.impls.expert_parallel)."""
    from .expert_parallel import run_experts_distributed  # needs process groups: loaded on first use
    crit = routing.crit._replace(capacity=agree_on_call(layer.group, x.device, routing.crit.capacity,
                                                                 call.overlap, call.adaptive_r))
    ctx = _context(layer, call, routing)
    features = []

    def local_experts(chunk: torch.Tensor) -> torch.Tensor:
        out = layer.run_local_experts(chunk, reserve_shape, ctx)
        features[:] = out.shape[2:]
        return out.reshape(out.size(0), out.size(1), math.prod(out.shape[2:]))

    y = fast_encode(x, crit, layer.is_postscore)
    y = run_experts_distributed(layer, y, call.overlap, call.adaptive_r, local_experts)
    y = fast_decode(y, crit, layer.is_postscore)
    return _result(y, features or [y.shape[-1]], routing, crit)


_ROUTED_PATHS: Dict[Path, Callable[..., LayerResult]] = {
    Path.GROUPED_ONE_CALL: _grouped_one_call,
    Path.GROUPED_PIECES: _grouped_pieces,
    Path.GROUPED: _grouped,
    Path.PADDED: _padded,
    Path.EXPERT_PARALLEL: _expert_parallel,
}
