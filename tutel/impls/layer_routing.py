"""moe_layer's routing of one call, in the form its path takes (tutel.paths.table): Tutel's crit tuple
and the auxiliary loss, route_experts' planned routing, or the one-pass routing of CPU inference."""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..ops import direct
from ..ops.route_experts import ExpertRouting, route_experts_softmax
from ..rules.autocast import without_autocast
from ..rules.capacity import expert_capacity
from . import losses
from .call_settings import CallSettings
from .fast_dispatch import CriticalData, route_critical
from .scored_routing import route_scored


class Routing(NamedTuple):
    crit: CriticalData
    l_aux: Optional[torch.Tensor]
    logits: torch.Tensor  # [T, E] the gate's logits (before noise)


class OnePassRouting(NamedTuple):
    """route_in_one_pass's result."""
    expert_ids: torch.Tensor      # [T, k] int32
    weights: torch.Tensor         # [T, k] the routing weights
    dispatch_count: torch.Tensor  # [E] int64 choices per expert, before the capacity
    l_aux: torch.Tensor           # [] the GShard loss
    logits: torch.Tensor          # [T, E] the gate's logits


def gate_logits(layer, gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gate's logits [T, E] for tokens x [T, M], checked against the layer's expert count."""
    logits = gate(x)
    if logits.dim() != 2 or logits.shape != (x.shape[0], layer.num_global_experts):
        raise ValueError(f"gate returned logits of shape {tuple(logits.shape)}; expected "
                         f"[tokens, num_global_experts] = [{x.shape[0]}, {layer.num_global_experts}]")
    return logits


def route_call(layer, x: torch.Tensor, call: CallSettings, sequence_length: int,
               inequivalent_tokens: bool) -> Routing:
    """Routes the tokens x [T, M] (in the compute dtype) with this call's settings.

    The gate noise of training is added to the logits; scored-routing options take
    tutel.impls.scored_routing, everything else Tutel's softmax top-k (extract_critical)."""
    gate, num_experts = call.gate, layer.num_global_experts
    with without_autocast(x.device.type):
        logits = gate_logits(layer, gate, x)
        noisy_logits = logits
        if layer.training and gate.gate_noise > 0:
            noisy_logits = logits + gate.gate_noise * torch.randn_like(logits) / num_experts
        routing = dict(capacity_factor=call.capacity_factor, batch_prioritized_routing=layer.batch_prioritized_routing,
                       alignment=call.alignment, group=layer.group, inequivalent_tokens=inequivalent_tokens)
        options = getattr(gate, "routing_options", None)
        if options is not None and not options.is_default:
            bias = getattr(gate, "selection_bias", None)
            crit, l_aux = route_scored(
                logits, noisy_logits, options, None if bias is None else bias.bias, call.top_k,
                gate_noise=gate.gate_noise, is_gshard_loss=layer.is_gshard_loss,
                normalize_gate=layer.normalize_gate, sequence_length=sequence_length, **routing)
            if bias is not None and layer.training:
                bias.record(crit.dispatch_count)  # the selection bias's update counts training calls
            return Routing(crit, l_aux, logits)
        scores = F.softmax(noisy_logits, dim=1)
        if layer.is_gshard_loss:
            loss_fn = losses.gshard_loss
        else:
            def loss_fn(_scores, topk_ids):
                return losses.load_importance_loss(
                    F.softmax(logits, dim=1), noisy_logits.gather(1, topk_ids), num_experts,
                    gate.gate_noise, logits_wo_noise=logits, noisy_logits=noisy_logits)
        # (the token count differs between processes with inequivalent_tokens: route_critical agrees on it)
        crit, l_aux = route_critical(scores, call.top_k, loss_fn=loss_fn, normalize_gate=layer.normalize_gate,
                                     capacity=None if inequivalent_tokens else call.static_capacity, **routing)
        return Routing(crit, l_aux, logits)


DROPLESS = -1


def planned_capacity(layer, call: CallSettings, tokens: int) -> int:
    """The call's static capacity per expert, or DROPLESS (-1) for capacity_factor = 0: both follow
    from the shapes alone (a negative capacity_factor, capped at the largest load, does not)."""
    if call.capacity_factor == 0:
        return DROPLESS
    if call.static_capacity is not None:  # (resolved for this call's token count)
        return call.static_capacity
    return expert_capacity(call.capacity_factor, call.top_k, tokens, layer.num_global_experts,
                           alignment=call.alignment)


def route_planned(layer, x: torch.Tensor, call: CallSettings) -> Tuple[torch.Tensor, ExpertRouting]:
    """The gate's logits and Tutel's routing of them by tutel.ops.route_experts (top-k, weights,
    slots, the grouped buffer's plan and the GShard loss, with no host synchronisation) at the
    call's planned capacity: every size follows from the shapes, so CUDA graphs capture it."""
    with without_autocast(x.device.type):
        logits = gate_logits(layer, call.gate, x)
    top_k = call.top_k
    return logits, route_experts_softmax(logits, top_k, top_k > 1 and layer.normalize_gate,
                                         bool(layer.batch_prioritized_routing),
                                         planned_capacity(layer, call, x.shape[0]))


def route_in_one_pass(layer, x: torch.Tensor, call: CallSettings) -> OnePassRouting:
    """CPU inference of Tutel's routing in one C++ pass (tutel.ops.direct.route_without_grad): the
    [T, k] choices and weights, the counts and the GShard loss, with the general routing's rounding
    (csrc/ops/cpu/routing_cpu.cpp); the gate's logits are computed as usual."""
    top_k = call.top_k
    logits = gate_logits(layer, call.gate, x)
    expert_ids, weights, dispatch_count, l_aux = direct.route_without_grad(
        F.softmax(logits, dim=1), top_k, top_k > 1 and layer.normalize_gate,
        planned_capacity(layer, call, x.shape[0]), layer.batch_prioritized_routing)
    return OnePassRouting(expert_ids, weights, dispatch_count, l_aux, logits)
