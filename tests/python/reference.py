"""Slow, obviously-correct float64 reference implementations in plain PyTorch.

Everything here is written for clarity, not speed: explicit loops over
choices and tokens, dense buffers, float64 arithmetic.
"""
import math

import torch


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] expert ids, best first; ties -> lower expert id; NaN ranks first."""
    values = scores.double().clone()
    nan = torch.isnan(values)
    values[nan] = math.inf
    ranked = []
    for row, row_nan in zip(values.tolist(), nan.tolist()):
        # sort key: NaN first, then by value descending, then by index ascending
        order = sorted(range(len(row)), key=lambda e: (not row_nan[e], -row[e], e))
        ranked.append(order[:k])
    return torch.tensor(ranked, dtype=torch.int64).reshape(len(ranked), k)


def gshard_locations(indices_tk: torch.Tensor, num_experts: int, priority=None):
    """GShard slot assignment as a nested loop with one counter per expert.

    Returns (locations [T, k], counts [k, E])."""
    tokens, k = indices_tk.shape
    order = list(range(tokens))
    if priority is not None:
        keys = priority.double().tolist()
        order = sorted(order, key=lambda t: -keys[t])  # stable: ties keep token order
    next_slot = [0] * num_experts
    locations = torch.zeros(tokens, k, dtype=torch.int64)
    counts = torch.zeros(k, num_experts, dtype=torch.int64)
    ids = indices_tk.tolist()
    for j in range(k):
        for t in order:
            e = ids[t][j]
            locations[t, j] = next_slot[e]
            next_slot[e] += 1
            counts[j, e] += 1
    return locations, counts


def encode(x, indices_tk, locations_tk, num_experts, capacity, gates_tk=None):
    """[E, C, M] float64 buffer: sum of gate * x[t] over the choices kept in each slot."""
    tokens, model_dim = x.shape
    out = torch.zeros(num_experts, capacity, model_dim, dtype=torch.float64)
    for t in range(tokens):
        for j in range(indices_tk.shape[1]):
            e, l = int(indices_tk[t, j]), int(locations_tk[t, j])
            if l < capacity:
                g = 1.0 if gates_tk is None else gates_tk[t, j].double()
                out[e, l] += g * x[t].double()
    return out


def decode(y, indices_tk, locations_tk, gates_tk=None):
    """[T, M] float64: sum over kept choices of gate * y[e, l]."""
    tokens, k = indices_tk.shape
    capacity = y.shape[1]
    out = torch.zeros(tokens, y.shape[2], dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            e, l = int(indices_tk[t, j]), int(locations_tk[t, j])
            if l < capacity:
                g = 1.0 if gates_tk is None else gates_tk[t, j].double()
                out[t] += g * y[e, l].double()
    return out


def dense_assignment(indices_tk, locations_tk, num_experts, capacity, gates_tk=None):
    """[T, E, C] float64 tensor: the gate weight of token t in slot (e, c), 0 elsewhere (GShard's
    dispatch / combine tensor).  Differentiable with respect to the gates."""
    tokens, k = indices_tk.shape
    assignment = torch.zeros(tokens, num_experts, capacity, dtype=torch.float64)
    for j in range(k):
        kept = locations_tk[:, j] < capacity
        t = torch.arange(tokens)[kept]
        weight = torch.ones(tokens, dtype=torch.float64) if gates_tk is None else gates_tk[:, j]
        one_hot = torch.zeros(tokens, num_experts, capacity, dtype=torch.float64)
        one_hot[t, indices_tk[kept, j], locations_tk[kept, j]] = 1.0
        assignment = assignment + one_hot * weight[:, None, None]
    return assignment


def encode_dense(x, indices_tk, locations_tk, num_experts, capacity, gates_tk=None):
    """Same as encode() through the dense [T, E, C] dispatch tensor (GShard einsum style)."""
    dispatch = dense_assignment(indices_tk, locations_tk, num_experts, capacity, gates_tk)
    return torch.einsum("tec,tm->ecm", dispatch, x.double())


def decode_dense(y, indices_tk, locations_tk, gates_tk=None):
    """Same as decode() through the dense [T, E, C] combine tensor."""
    combine = dense_assignment(indices_tk, locations_tk, y.shape[0], y.shape[1], gates_tk)
    return torch.einsum("tec,ecm->tm", combine, y.double())


def capacity(capacity_factor, top_k, tokens, experts, loads, alignment=1):
    """Tutel's capacity rule spelled out."""
    share = -(-tokens // experts)
    if capacity_factor > 0:
        c = top_k * int(capacity_factor * share)
    else:
        c = int(max(loads)) if len(loads) else 0
        if capacity_factor < 0:
            c = min(c, top_k * int(-capacity_factor * share))
    while c % alignment:
        c += 1
    return c


def gshard_loss(scores, top1):
    tokens, experts = scores.shape
    me = scores.double().mean(0)
    ce = torch.zeros(experts, dtype=torch.float64)
    for e in top1.tolist():
        ce[e] += 1.0 / tokens
    return experts * (me * ce).sum()
