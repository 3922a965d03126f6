"""Float64 reference of scored routing (docs/routing.md), written token by token from the formulas.

Nothing here calls tutel: scores, group limiting, top-k, weights, the balance losses, the
selection-bias update, gpt-oss's clamped SwiGLU and the shared experts are spelled out with
Python loops and plain tensor arithmetic.  Differentiable in the logits and in every weight.
"""
import torch

import reference


def score_of(z, score_function):
    """s = score_function(z) for one token's logits z [E]."""
    if score_function == "softmax":
        e = torch.exp(z - z.max())
        return e / e.sum()
    if score_function == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-z))
    if score_function == "sqrt_softplus":
        return torch.sqrt(torch.log1p(torch.exp(z)))
    raise AssertionError(score_function)


def route_token(z, k, score_function="softmax", softmax_after_topk=False, bias=None, n_group=None,
                topk_group=None, renormalize=False, scale=1.0):
    """One token: (k expert ids, best first; their weights [k]; the top-1 choice score)."""
    experts = z.shape[0]
    s = score_of(z, score_function)
    base = (z if softmax_after_topk else s).tolist()
    choice = [base[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(experts)]
    allowed = list(range(experts))
    if n_group is not None:
        size = experts // n_group
        group_score = []
        for g in range(n_group):
            members = sorted((choice[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            group_score.append(sum(members[:2]))
        best = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        allowed = [e for e in range(experts) if e // size in best]
    ids = sorted(allowed, key=lambda e: (-choice[e], e))[:k]
    if softmax_after_topk:
        chosen = torch.stack([z[e] for e in ids])
        w = torch.exp(chosen - chosen.max())
        w = w / w.sum()
    else:
        w = torch.stack([s[e] for e in ids])
    if renormalize:
        w = w / w.sum()
    return ids, w * scale, choice[ids[0]]


def affinity_of(z, score_function, softmax_after_topk):
    """Scores normalised to sum to one over the experts (what the balance losses average)."""
    s = score_of(z, "softmax" if softmax_after_topk else score_function)
    return s / s.sum()


def sequence_loss(affinity, ids, k, sequence_length):
    """DeepSeek-V3: mean over sequences of sum_e (E / (k S) * count_e) * mean_t p[t, e]."""
    tokens, experts = affinity.shape
    losses = []
    for start in range(0, tokens, sequence_length):
        count = [0] * experts
        for t in range(start, start + sequence_length):
            for e in ids[t]:
                count[e] += 1
        total = 0
        for e in range(experts):
            f = experts / (k * sequence_length) * count[e]
            total = total + f * affinity[start:start + sequence_length, e].mean()
        losses.append(total)
    return torch.stack(losses).mean()


def global_batch_loss(affinity, ids, all_ids=None):
    """Qwen3: E * sum_e (choices of e / tokens, over `all_ids` = every process's ids) * mean_t p[t, e]."""
    tokens, experts = affinity.shape
    all_ids = ids if all_ids is None else all_ids
    count = [0] * experts
    for row in all_ids:
        for e in row:
            count[e] += 1
    return experts * sum(count[e] / len(all_ids) * affinity[:, e].mean() for e in range(experts))


def z_loss(logits):
    return torch.stack([torch.log(torch.exp(row).sum()) ** 2 for row in logits]).mean()


def bias_step(bias, loads, rate):
    """b_e += rate * sign(mean load - load_e), one expert at a time."""
    mean = sum(loads) / len(loads)
    return [b + rate * (0.0 if load == mean else (1.0 if mean > load else -1.0)) for b, load in zip(bias, loads)]


def clamped_swiglu(h, w_gu, b_gu, w_down, b_down, alpha=1.702, limit=7.0, interleaved=True):
    """gpt-oss's expert on one token h [M] (w_gu [M, 2I], w_down [I, M])."""
    gate_up = h @ w_gu + (b_gu if b_gu is not None else 0)
    half = w_down.shape[0]
    if interleaved:
        gate = torch.stack([gate_up[2 * i] for i in range(half)])
        up = torch.stack([gate_up[2 * i + 1] for i in range(half)])
    else:
        gate, up = gate_up[:half], gate_up[half:]
    if limit is not None:
        gate = torch.where(gate > limit, torch.full_like(gate, limit), gate)
        up = torch.where(up > limit, torch.full_like(up, limit),
                         torch.where(up < -limit, torch.full_like(up, -limit), up))
    glu = gate / (1.0 + torch.exp(-alpha * gate))
    return ((up + 1) * glu) @ w_down + (b_down if b_down is not None else 0)


def shared_swiglu(h, gate_w, up_w, down_w, sigmoid_w=None):
    """Shared experts on one token: down(silu(gate h) * up h), times sigmoid(w . h) when gated."""
    g = h @ gate_w.t()
    y = (g / (1.0 + torch.exp(-g)) * (h @ up_w.t())) @ down_w.t()
    if sigmoid_w is not None:
        y = y / (1.0 + torch.exp(-(h @ sigmoid_w.t())))
    return y


def scored_moe(x, logits, expert_fn, k, capacity_factor, route, *, is_postscore=True, batch_prioritized=False,
               alignment=1, loss="gshard", sequence_length=None, z_loss_weight=0.0, all_ids=None,
               agree_capacity=None):
    """The layer on x [T, M]: routing `route` (route_token's keyword arguments), Tutel's capacity
    and GShard slot order, experts token by token, the chosen balance loss plus z_loss_weight * z.
    Distributed checks pass `all_ids(ids) -> every process's ids` for the global-batch loss and
    `agree_capacity(capacity) -> capacity` for the processes' agreement.

    Returns (output [T, O], l_aux, ids [T][k], kept [T][k])."""
    tokens, experts = logits.shape
    routed = [route_token(logits[t], k, **route) for t in range(tokens)]
    ids = [r[0] for r in routed]
    ids_tensor = torch.tensor(ids, dtype=torch.int64).reshape(tokens, k)
    priority = torch.tensor([r[2] for r in routed], dtype=torch.float64) if batch_prioritized else None
    locations, counts = reference.gshard_locations(ids_tensor, experts, priority)
    capacity = reference.capacity(capacity_factor, k, tokens, experts, counts.sum(0).tolist(), alignment)
    if agree_capacity is not None:
        capacity = agree_capacity(capacity)
    kept = (locations < capacity).tolist()
    rows = []
    for t in range(tokens):
        total = None
        for j in range(k):
            if not kept[t][j]:
                continue
            g = routed[t][1][j]
            h = expert_fn(ids[t][j], x[t] if is_postscore else g * x[t])
            part = g * h if is_postscore else h
            total = part if total is None else total + part
        rows.append(total)
    width = expert_fn(0, x.new_zeros(x.shape[1])).shape[0]
    if not tokens:
        return x.new_zeros(0, width), logits.sum() * 0, ids, kept
    output = torch.stack([r if r is not None else x.new_zeros(width) for r in rows])

    route_kinds = dict(score_function=route.get("score_function", "softmax"),
                       softmax_after_topk=route.get("softmax_after_topk", False))
    affinity = torch.stack([affinity_of(logits[t], **route_kinds) for t in range(tokens)])
    if loss == "gshard":
        l_aux = reference.gshard_loss(affinity, ids_tensor[:, 0])
    elif loss == "sequence":
        l_aux = sequence_loss(affinity, ids, k, sequence_length or tokens)
    elif loss == "global_batch":
        l_aux = global_batch_loss(affinity, ids, all_ids(ids) if all_ids is not None else None)
    else:
        l_aux = logits.sum() * 0
    if z_loss_weight:
        l_aux = l_aux + z_loss_weight * z_loss(logits)
    return output, l_aux, ids, kept

