"""Auxiliary router losses of 2022-26 MoE models (besides GShard's and load/importance in losses.py).

Notation: T tokens, E experts, k choices per token, ``affinity`` p [T, E] the routing scores
normalised over all experts (softmax probabilities, or sigmoid scores divided by their sum), and
``topk_ids`` [T, k] the chosen experts.
"""
import torch

from ..collectives.simple_collectives import simple_all_reduce


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp_e(z[t, e])^2 (0 for no token)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0
    return torch.logsumexp(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits,
                           dim=1).square().mean()


def _choice_counts(topk_ids: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., E]: how many of the choices in the trailing dims of topk_ids [..., n] went to each expert."""
    counts = torch.zeros(*topk_ids.shape[:-1], num_experts, dtype=dtype, device=topk_ids.device)
    return counts.scatter_add_(-1, topk_ids, torch.ones_like(topk_ids, dtype=dtype))


def sequence_balance_loss(affinity: torch.Tensor, topk_ids: torch.Tensor, sequence_length: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the sequences.

    Tokens form consecutive sequences of ``sequence_length``; for each sequence of S tokens
    ``sum_e f_e * P_e`` with ``f_e = E / (k S) * (choices of e in the sequence)`` and
    ``P_e = mean_t p[t, e]``.  It is 1 when every sequence spreads its choices evenly."""
    tokens, num_experts = affinity.shape
    if tokens == 0:
        return affinity.sum() * 0
    top_k = topk_ids.shape[1]
    sequences = tokens // sequence_length
    ids = topk_ids.reshape(sequences, sequence_length * top_k)
    fraction = _choice_counts(ids, num_experts, affinity.dtype) * (num_experts / (top_k * sequence_length))
    mean_affinity = affinity.reshape(sequences, sequence_length, num_experts).mean(dim=1)
    return (fraction * mean_affinity).sum(dim=1).mean()


def global_batch_balance_loss(affinity: torch.Tensor, topk_ids: torch.Tensor, group=None) -> torch.Tensor:
    """Qwen3's global-batch balance loss: ``E * sum_e f_e * P_e`` where ``f_e`` is the share of
    all tokens of the process group choosing e (counts and token totals summed over ``group``,
    no gradient) and ``P_e`` this process's mean affinity.  One process gives transformers'
    ``load_balancing_loss_func`` of one layer; it is k when the choices spread evenly."""
    tokens, num_experts = affinity.shape
    counts = _choice_counts(topk_ids.reshape(-1), num_experts, torch.float64)
    totals = simple_all_reduce(torch.cat([counts, counts.new_tensor([tokens])]), group=group)
    fraction = (totals[:-1] / totals[-1].clamp_min(1)).to(affinity.dtype)
    mean_affinity = affinity.sum(dim=0) / max(tokens, 1)
    return (fraction * mean_affinity).sum() * num_experts
