"""moe_layer's routing of one call: gate logits -> Tutel's crit tuple and the auxiliary loss."""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..rules.autocast import without_autocast
from ..rules.capacity import capacity_alignment
from . import losses
from .call_settings import CallSettings
from .fast_dispatch import CriticalData, route_critical
from .scored_routing import route_scored


class Routing(NamedTuple):
    crit: CriticalData
    l_aux: Optional[torch.Tensor]
    logits: torch.Tensor  # [T, E] the gate's logits (before noise)


def gate_logits(layer, gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gate's logits [T, E] for tokens x [T, M], checked against the layer's expert count."""
    logits = gate(x)
    if logits.dim() != 2 or logits.shape != (x.shape[0], layer.num_global_experts):
        raise ValueError(f"gate returned logits of shape {tuple(logits.shape)}; expected "
                         f"[tokens, num_global_experts] = [{x.shape[0]}, {layer.num_global_experts}]")
    return logits


def uses_tutel_routing(layer, gate: torch.nn.Module) -> bool:
    """Softmax top-k routing with the GShard loss and no gate noise in this call (Tutel's default)."""
    options = getattr(gate, "routing_options", None)
    return layer.is_gshard_loss and (options is None or options.is_default) and \
        not (layer.training and gate.gate_noise > 0)


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
        alignment = capacity_alignment(layer.sharded_count, call.overlap, call.megablocks_size)
        routing = dict(capacity_factor=call.capacity_factor, batch_prioritized_routing=layer.batch_prioritized_routing,
                       alignment=alignment, group=layer.group, inequivalent_tokens=inequivalent_tokens)
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
        crit, l_aux = route_critical(scores, call.top_k, loss_fn=loss_fn, normalize_gate=layer.normalize_gate,
                                     **routing)
        return Routing(crit, l_aux, logits)
