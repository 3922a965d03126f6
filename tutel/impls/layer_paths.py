"""moe_layer's side of the paths: the path a call takes (tutel.rules.paths, on the facts of
tutel.paths.facts), the call's routing in the form that path takes, and its result.

``run_path`` routes the call as the path's row of tutel.paths.table says (Tutel's crit tuple,
route_experts' planned routing, or the one-pass routing of CPU inference), hands the layer's experts
module with the call's context (tutel.impls.call_context) to tutel.paths.run, and returns what the
path computed as a ``LayerResult`` (the output, the loss, the counts, the routing weights and the
gate's logits); no path leaves results on the layer.
"""
from typing import Sequence

import torch

from ..paths import ModuleExperts, Work, run
from ..paths.facts import layer_facts
from ..paths.table import ONE_PASS, PLANNED, STAGES
from ..rules.paths import LAYER, Path, PathChoice, choose_path
from .call_context import CallContext, LayerResult
from .call_settings import CallSettings
from .layer_routing import route_call, route_in_one_pass, route_planned


def choose_layer_path(layer, x: torch.Tensor, call: CallSettings, reserve_dims: int) -> PathChoice:
    """The path of a call of `layer` on tokens x [T, M], with the reason."""
    return choose_path(LAYER, layer_facts(layer, x, call, reserve_dims))


def _experts(layer, call: CallSettings, dispatch_count: torch.Tensor, reserve_shape: Sequence[int]) -> ModuleExperts:
    # (world_size copied too: every built-in experts module reads it, and a name the context lacks
    # costs a __getattr__ call)
    ctx = CallContext(layer, adaptive_degree=call.adaptive_r, a2a_ffn_overlap_degree=call.overlap,
                      megablocks_size=call.megablocks_size, dispatch_count=dispatch_count,
                      local_dispatch_count=dispatch_count, world_size=layer.world_size)
    return ModuleExperts(layer, ctx, reserve_shape)


def run_path(path: Path, layer, x: torch.Tensor, call: CallSettings, reserve_shape: Sequence[int],
             sequence_length: int, inequivalent_tokens: bool) -> LayerResult:
    """Runs `path` for tokens x [T, M] (in the compute dtype)."""
    routing_kind = STAGES[path].routing
    if routing_kind == PLANNED:
        logits, routing = route_planned(layer, x, call)
        experts = _experts(layer, call, routing.dispatch_count, reserve_shape)
        work = run(path, Work(x, experts, expert_ids=routing.expert_ids.t(), weights=routing.weights.t(),
                              routing=routing, at_combine=layer.is_postscore))
        return LayerResult(work.y, work.features, routing.l_aux, routing.dispatch_count, routing.weights.unbind(0),
                           logits)
    if routing_kind == ONE_PASS:
        routing = route_in_one_pass(layer, x, call)
        experts = _experts(layer, call, routing.dispatch_count, reserve_shape)
        work = run(path, Work(x, experts, expert_ids=routing.expert_ids, weights=routing.weights))
        y = work.y  # (.to costs a dispatch even with nothing to do)
        return LayerResult(y if y.dtype == x.dtype else y.to(x.dtype), work.features, routing.l_aux,
                           routing.dispatch_count, routing.weights.unbind(1), routing.logits)
    routing = route_call(layer, x, call, sequence_length, inequivalent_tokens)
    crit = routing.crit
    experts = _experts(layer, call, crit.dispatch_count, reserve_shape)
    work = run(path, Work(x, experts, crit=crit, at_combine=layer.is_postscore, dropless=call.capacity_factor == 0,
                          megablocks_size=call.megablocks_size))
    y = work.y
    return LayerResult(y if y.dtype == x.dtype else y.to(x.dtype), work.features, routing.l_aux,
                       work.crit.dispatch_count, work.crit.gates_s, routing.logits)
