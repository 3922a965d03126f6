"""A float64 MoE layer written token by token, with no buffers at all.

Every kept (token, choice) pair runs its expert on that one token; the output is
the gate-weighted sum.  Routing follows Tutel's documented rules (reference.py).
Differentiable: autograd gives the reference gradients of everything.
"""
import torch

import reference


def ffn_expert(params, e, h, activation):
    w1, b1, w2, b2 = params
    h = h @ w1[e].t()
    if b1 is not None:
        h = h + b1[e]
    h = activation(h) @ w2[e]
    if b2 is not None:
        h = h + b2[e]
    return h


def moe_forward(x, logits, expert_fn, top_k, capacity_factor, *, normalize_gate=True, is_postscore=True,
                batch_prioritized=False, alignment=1, loss="gshard", route_with=None, agree_capacity=None):
    """x [T, M] float64, logits [T, E] float64 (differentiable), expert_fn(e, h [M]) -> [O].

    `route_with` (optional [T, E] logits) makes the top-k choices and slot order come from these
    logits instead: low-precision layers are compared on their own routing decisions.
    `agree_capacity(local_capacity) -> capacity` lets distributed tests apply the processes' agreement.

    Returns (output [T, O], l_aux, capacity, kept mask [T, k])."""
    tokens, experts = logits.shape
    scores = torch.softmax(logits, dim=1)
    route_scores = scores.detach() if route_with is None else torch.softmax(route_with.double(), dim=1)
    ids = reference.topk_indices(route_scores, top_k)
    gates = scores.gather(1, ids)
    if top_k > 1 and normalize_gate:
        gates = gates / torch.clamp(gates.sum(1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    priority = route_scores.gather(1, ids[:, :1]).squeeze(1) if batch_prioritized else None
    locations, counts = reference.gshard_locations(ids, experts, priority)
    capacity = reference.capacity(capacity_factor, top_k, tokens, experts, counts.sum(0).tolist(), alignment)
    if agree_capacity is not None:
        capacity = agree_capacity(capacity)
    kept = locations < capacity

    rows = []
    for t in range(tokens):
        total = None
        for j in range(top_k):
            if not kept[t, j]:
                continue
            g = gates[t, j]
            h = expert_fn(int(ids[t, j]), x[t] if is_postscore else g * x[t])
            contribution = g * h if is_postscore else h
            total = contribution if total is None else total + contribution
        rows.append(total)
    width = next((r.shape[0] for r in rows if r is not None), None)
    if width is None:
        width = expert_fn(0, x.new_zeros(x.shape[1])).shape[0] if tokens else 0
    output = torch.stack([r if r is not None else x.new_zeros(width) for r in rows]) if tokens else \
        x.new_zeros(0, width)
    if loss == "gshard":
        l_aux = reference.gshard_loss(scores, ids[:, 0]) if tokens else scores.sum() * 0
    else:
        l_aux = None
    return output, l_aux, capacity, kept
