"""Auxiliary load-balancing losses for top-k gates."""
import math
from typing import Optional

import torch


def _expert_histogram(expert_ids: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Number of tokens per expert, as a [E] tensor of `dtype` (no [T, E] one-hot)."""
    counts = torch.zeros(num_experts, dtype=dtype, device=expert_ids.device)
    return counts.scatter_add_(0, expert_ids.long(), torch.ones_like(expert_ids, dtype=dtype))


def gshard_loss(scores_w_noise: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """GShard / Switch load-balancing loss.

    ``E * sum_e mean_t(p[t, e]) * (fraction of tokens whose first choice is e)``,
    where p are the (noisy) routing probabilities [T, E] and top_ids the [T, k]
    choices.  It equals 1 under perfect balance.  An empty batch gives 0.
    """
    num_experts = scores_w_noise.shape[1]
    return gshard_loss_from_counts(scores_w_noise, _expert_histogram(top_ids[:, 0], num_experts, scores_w_noise.dtype))


def gshard_loss_from_counts(scores_w_noise: torch.Tensor, first_choice_counts: torch.Tensor) -> torch.Tensor:
    """gshard_loss given the [E] number of tokens whose first choice is each expert (the routing
    operator counts them already)."""
    num_tokens, num_experts = scores_w_noise.shape
    if num_tokens == 0:
        return scores_w_noise.sum() * 0
    # E * sum_e mean_t(scores[t, e]) * counts[e] / T, as one dot product of the score sums and the
    # counts scaled by E / T^2 (four operations in place of six: a tiny layer's loss cost as
    # much as its experts)
    return torch.dot(scores_w_noise.sum(dim=0), first_choice_counts.to(scores_w_noise.dtype)) * \
        (num_experts / (num_tokens * num_tokens))


def _accumulation(values: torch.Tensor) -> torch.Tensor:
    """float64 stays float64 (the layer computes float64 in float64); everything else in float32."""
    return values if values.dtype == torch.float64 else values.float()


def _squared_coefficient_of_variation(values: torch.Tensor) -> torch.Tensor:
    values = _accumulation(values)
    if values.numel() < 2:
        return values.sum() * 0
    return values.var() / (values.mean() ** 2 + 1e-10)


def load_importance_loss(scores_wo_noise: torch.Tensor, topk_logits: torch.Tensor,
                         num_global_experts: int, gate_noise: float,
                         logits_wo_noise: Optional[torch.Tensor] = None,
                         noisy_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Importance + load loss of Shazeer et al. (2017), ``(CV²(importance) + CV²(load)) / 2``.

    * importance[e] = sum_t p[t, e] with p the noise-free routing probabilities;
    * load[e] = sum_t P(e is among token t's top-k), where, with Gaussian noise of
      standard deviation sigma = gate_noise / E added to the logits,
      ``P = Phi((logit[t, e] - threshold[t, e]) / sigma)`` and threshold[t, e] is
      the k-th largest noisy logit of token t among the experts other than e.

    Unlike the reference, the load term compares logits with logits (the
    reference subtracts a logit threshold from a probability), so it needs the
    noise-free logits ``logits_wo_noise`` [T, E] and the noisy logits
    ``noisy_logits`` [T, E] (the MoE layer passes both).  ``topk_logits`` [T, k]
    (the noisy logits of the chosen experts) is kept for signature
    compatibility and gives k.
    """
    if gate_noise is None or not gate_noise > 0:
        raise ValueError(f"load_importance_loss needs gate_noise > 0, got {gate_noise}")
    if logits_wo_noise is None or noisy_logits is None:
        raise TypeError("load_importance_loss needs `logits_wo_noise` and `noisy_logits` [T, E]: the load "
                        "term compares logits with the k-th largest noisy logit")
    num_tokens = scores_wo_noise.shape[0]
    if num_tokens == 0:
        return scores_wo_noise.sum() * 0
    top_k = topk_logits.shape[1]
    l_importance = _squared_coefficient_of_variation(_accumulation(scores_wo_noise).sum(dim=0))

    noisy = _accumulation(noisy_logits)
    ranked = torch.topk(noisy, min(top_k + 1, num_global_experts), dim=1)
    kth = ranked.values[:, top_k - 1:top_k]  # k-th largest noisy logit
    if top_k < num_global_experts:
        next_after = ranked.values[:, top_k:top_k + 1]  # (k+1)-th largest
    else:
        next_after = torch.full_like(kth, -math.inf)
    # Excluding expert e itself: experts inside the top-k compete with the
    # (k+1)-th logit, the others with the k-th.
    in_top_k = torch.zeros_like(noisy, dtype=torch.bool).scatter_(1, ranked.indices[:, :top_k], True)
    threshold = torch.where(in_top_k, next_after, kth)
    sigma = gate_noise / num_global_experts
    normal = torch.distributions.Normal(0.0, sigma)
    probability = normal.cdf(_accumulation(logits_wo_noise) - threshold)
    l_load = _squared_coefficient_of_variation(probability.sum(dim=0))
    return (l_importance + l_load) / 2.0
