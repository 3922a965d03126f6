"""Runs a layer with scored-routing options and the float64 reference of reference_scored.py on the
same inputs and compares outputs, l_aux and every gradient (input, gate, experts, shared experts)."""
import torch

import reference_scored as ref
from layer_harness import float64_copy, ffn_expert_reference
from tutel import moe

MODEL_DIM, HIDDEN = 6, 5


def gate_reference(gate):
    weight = float64_copy(gate.wg.weight)
    bias = float64_copy(gate.wg.bias)
    pairs = [(gate.wg.weight, weight)] + ([(gate.wg.bias, bias)] if bias is not None else [])
    return (lambda x64: x64 @ weight.t() + (bias if bias is not None else 0)), pairs


def clamped_reference(experts):
    names = ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]
    copies = [float64_copy(getattr(experts, n)) for n in names]

    def expert_fn(e, h):
        w_gu, b_gu, w_down, b_down = (c[e] if c is not None else None for c in copies)
        return ref.clamped_swiglu(h, w_gu, b_gu, w_down, b_down, experts.alpha, experts.limit, experts.interleaved)

    return expert_fn, [(getattr(experts, n), c) for n, c in zip(names, copies)]


def shared_reference(shared):
    modules = [shared.gate_proj, shared.up_proj, shared.down_proj] + ([shared.gate] if shared.gate is not None else [])
    copies = [float64_copy(m.weight) for m in modules]
    return (lambda h: ref.shared_swiglu(h, *copies)), [(m.weight, c) for m, c in zip(modules, copies)]


def compare(layer, x, route, *, k, capacity_factor, loss, z_loss_weight=0.0, forward_kwargs=None, tol=1e-10,
            expert_reference=None, sequence_length=None, gate_index=0, alignment=1):
    """Forward + backward of `layer` and of the reference on x; asserts outputs, l_aux and every
    gradient (input, gate, experts, shared experts) agree.  Returns the reference's ids."""
    forward_kwargs = dict(forward_kwargs or {}, gate_index=gate_index)
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = layer(x, **forward_kwargs)
    upstream = torch.randn(y.shape, dtype=torch.float64)
    ((y.double() * upstream).sum() + 0.3 * y.l_aux.double()).backward()

    x64 = x.detach().double().reshape(-1, MODEL_DIM).requires_grad_()
    logits_fn, pairs = gate_reference(layer.gates[gate_index])
    expert_fn, expert_pairs = (expert_reference or ffn_expert_reference)(layer.experts)
    pairs += expert_pairs
    if layer.shared_experts is not None:
        shared_fn, shared_pairs = shared_reference(layer.shared_experts)
        pairs += shared_pairs
    out64, l_aux64, ids, kept = ref.scored_moe(
        x64, logits_fn(x64), expert_fn, k, capacity_factor, route, is_postscore=layer.is_postscore,
        batch_prioritized=layer.batch_prioritized_routing, loss=loss, z_loss_weight=z_loss_weight,
        sequence_length=sequence_length, alignment=alignment)
    if layer.shared_experts is not None:
        out64 = out64 + torch.stack([shared_fn(h) for h in x64])
    out64 = out64.reshape(y.shape)
    ((out64 * upstream).sum() + 0.3 * l_aux64).backward()

    close = dict(rtol=tol, atol=tol)
    torch.testing.assert_close(y.double(), out64.detach(), **close)
    torch.testing.assert_close(y.l_aux.double(), l_aux64.detach(), **close)
    torch.testing.assert_close(x.grad.double().reshape(-1, MODEL_DIM), x64.grad, **close)
    for param, copy in pairs:
        if param is None:
            continue
        expected = copy.grad if copy.grad is not None else torch.zeros_like(copy)
        torch.testing.assert_close(param.grad.double(), expected, **close, msg=lambda m: f"{tuple(param.shape)}: {m}")
    return ids, kept


def randomize_bias(layer, gate_index=0, scale=0.3):
    bias = layer.gates[gate_index].selection_bias.bias
    with torch.no_grad():
        bias.copy_(torch.randn(bias.shape, dtype=bias.dtype) * scale)
    return bias.detach().clone()


def capacity_for(k):
    """Dropless, static (with drops), tight static and capped dynamic capacities in turn."""
    return [0.0, 1.0, 0.5, -1.5][k % 4]


def make(gate, experts=None, num_experts=9, **layer_kwargs):
    experts = dict(experts or {"type": "ffn", "hidden_size_per_expert": HIDDEN})
    experts["num_experts_per_device"] = num_experts
    return moe.moe_layer(gate_type=gate, model_dim=MODEL_DIM, experts=experts, **layer_kwargs).double()
