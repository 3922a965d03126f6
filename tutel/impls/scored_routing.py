"""One MoE call's routing under a gate's scored-routing options (tutel.gates.scoring).

With z [T, E] the gate's logits (plus gate noise in training), s = score_function(z), b the
selection bias (0 without one):

1. choice c = s + b (or z + b with softmax_after_topk), restricted to the token's topk_group
   best groups when n_group is set;
2. the k experts with the largest c (ties: lower expert id), slots in GShard order;
3. weights w_j = s[e_j] (or softmax_j(z[e_1..e_k]) with softmax_after_topk), divided by their
   sum when renormalising, times routed_scaling_factor;
4. l_aux = balance loss + z_loss_weight * router z-loss.
"""
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ..gates import scoring
from . import losses, router_losses
from .fast_dispatch import CriticalData, normalize_gates, route_critical


def _balance_loss(name: str, logits: torch.Tensor, noisy_logits: torch.Tensor, affinity: torch.Tensor,
                  gate_noise: float, num_experts: int, sequence_length: int, group) -> Callable:
    """loss_fn(_choice_scores, topk_ids [T, k]) for extract_critical."""
    def loss_fn(_choice_scores: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if name == "gshard":
            return losses.gshard_loss(affinity, topk_ids)
        if name == "load_importance":
            return losses.load_importance_loss(F.softmax(logits, dim=1), noisy_logits.gather(1, topk_ids),
                                               num_experts, gate_noise, logits_wo_noise=logits,
                                               noisy_logits=noisy_logits)
        if name == "sequence":
            return router_losses.sequence_balance_loss(affinity, topk_ids, sequence_length)
        if name == "global_batch":
            return router_losses.global_batch_balance_loss(affinity, topk_ids, group)
        return affinity.sum() * 0  # 'none': balanced by the selection bias alone
    return loss_fn


def route_scored(logits: torch.Tensor, noisy_logits: torch.Tensor, options: scoring.RoutingOptions,
                 selection_bias: Optional[torch.Tensor], top_k: int, *, gate_noise: float, is_gshard_loss: bool,
                 normalize_gate: bool, sequence_length: int, **routing) -> Tuple[CriticalData, torch.Tensor]:
    """(crit, l_aux) of one call (top_k already checked against the groups); ``routing`` holds
    extract_critical's capacity arguments
    (capacity_factor, batch_prioritized_routing, alignment, group, inequivalent_tokens)."""
    num_experts = logits.shape[1]
    scores = scoring.score(noisy_logits, options.score_function)
    choice = (noisy_logits if options.softmax_after_topk else scores).detach()
    if selection_bias is not None:
        choice = choice + selection_bias.to(choice.dtype)
    if options.groups_limited:
        choice = scoring.limit_groups(choice, options.n_group, options.topk_group)
    renormalize = scoring.should_renormalize(options, top_k, normalize_gate)

    def gate_values(indices: torch.Tensor) -> torch.Tensor:
        chosen = indices.long()  # [k, T]
        if options.softmax_after_topk:
            weights = F.softmax(noisy_logits.t().gather(0, chosen), dim=0)
        else:
            weights = scores.t().gather(0, chosen)
        if renormalize:
            weights = normalize_gates(weights)
        return weights * options.routed_scaling_factor if options.routed_scaling_factor != 1.0 else weights

    balance = options.balance_loss or ("gshard" if is_gshard_loss else "load_importance")
    if balance == "load_importance" and options.score_function != "softmax":
        raise ValueError(f"moe_layer(is_gshard_loss=False) asks for the load/importance loss, which models "
                         f"softmax routing; it contradicts the gate's score_function={options.score_function!r} "
                         f"(set the gate option balance_loss, e.g. 'sequence' or 'global_batch')")
    affinity = scoring.affinity(F.softmax(noisy_logits, dim=1) if options.softmax_after_topk else scores,
                                options.score_function)
    loss_fn = _balance_loss(balance, logits, noisy_logits, affinity, gate_noise, num_experts, sequence_length,
                            routing.get("group"))
    crit, l_aux = route_critical(choice, top_k, loss_fn=loss_fn, normalize_gate=False, gate_values=gate_values,
                                   **routing)
    if options.z_loss_weight > 0:
        l_aux = l_aux + options.z_loss_weight * router_losses.router_z_loss(logits).to(l_aux.dtype)
    return crit, l_aux
