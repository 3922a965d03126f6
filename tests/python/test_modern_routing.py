"""Scored routing (score functions, selection bias, group-limited top-k, renormalisation, scaling,
z-loss, sequence-wise and global-batch losses), shared experts and clamped SwiGLU experts against
the float64 reference of reference_scored.py: outputs, l_aux and every gradient."""
import pytest
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


KS = list(range(1, 9))


@pytest.mark.parametrize("k", KS)
def test_softmax_renormalised_with_global_batch_loss(k):
    """Qwen3-MoE / Mixtral: softmax over all experts, top-k, renormalised (k > 1), Qwen3's loss."""
    layer = make({"type": "top", "k": k, "balance_loss": "global_batch", "capacity_factor": capacity_for(k)})
    compare(layer, torch.randn(23, MODEL_DIM, dtype=torch.float64), dict(renormalize=k > 1), k=k,
            capacity_factor=capacity_for(k), loss="global_batch")


@pytest.mark.parametrize("k", KS)
def test_sigmoid_bias_groups_scaling_sequence_loss(k):
    """DeepSeek-V3: sigmoid, biased choice within the best groups, renormalised, scaled, z-loss."""
    gate = {"type": "top", "k": k, "score_function": "sigmoid", "selection_bias": True, "n_group": 5,
            "topk_group": 3, "routed_scaling_factor": 2.5, "balance_loss": "sequence", "z_loss_weight": 0.01,
            "capacity_factor": capacity_for(k)}
    layer = make(gate, num_experts=15, batch_prioritized_routing=(k % 2 == 0))
    bias = randomize_bias(layer)
    ids, _ = compare(layer, torch.randn(3, 7, MODEL_DIM, dtype=torch.float64),
                     dict(score_function="sigmoid", bias=bias, n_group=5, topk_group=3, renormalize=k > 1, scale=2.5),
                     k=k, capacity_factor=capacity_for(k), loss="sequence", z_loss_weight=0.01, sequence_length=7)
    for row in ids:  # every token stays inside 3 of the 5 groups
        assert len({e // 3 for e in row}) <= 3


@pytest.mark.parametrize("k", KS)
def test_sqrt_softplus_always_renormalised(k):
    """DeepSeek-V4 style: sqrt(softplus) scores, bias, renormalise=True (also for k = 1), scaling."""
    gate = {"type": "top", "k": k, "score_function": "sqrt_softplus", "selection_bias": True, "renormalize": True,
            "routed_scaling_factor": 1.5, "balance_loss": "none", "capacity_factor": capacity_for(k)}
    layer = make(gate, num_experts=11)
    bias = randomize_bias(layer, scale=0.5)
    compare(layer, torch.randn(19, MODEL_DIM, dtype=torch.float64),
            dict(score_function="sqrt_softplus", bias=bias, renormalize=True, scale=1.5), k=k,
            capacity_factor=capacity_for(k), loss="none")


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("interleaved", [True, False])
def test_gpt_oss_router_and_clamped_swiglu_experts(k, interleaved):
    """gpt-oss: a router with a bias, softmax over the k chosen logits, clamped SwiGLU experts."""
    gate = {"type": "top", "k": k, "router_bias": True, "softmax_after_topk": True, "balance_loss": "gshard",
            "capacity_factor": capacity_for(k)}
    experts = {"type": "clamped_swiglu", "hidden_size_per_expert": HIDDEN, "limit": 0.4, "interleaved": interleaved}
    layer = make(gate, experts, num_experts=9)
    with torch.no_grad():
        layer.gates[0].wg.bias.normal_()
    x = torch.randn(21, MODEL_DIM, dtype=torch.float64) * 2
    compare(layer, x, dict(softmax_after_topk=True, renormalize=k > 1), k=k, capacity_factor=capacity_for(k),
            loss="gshard", expert_reference=clamped_reference)
    # limit 0.4 clamps many values on both sides: the test covers the clamped branches
    gate_up = torch.einsum("tm,emi->tei", x, layer.experts.gate_up_proj.detach()) + layer.experts.gate_up_proj_bias.detach()
    assert (gate_up > 0.4).any() and (gate_up < -0.4).any() and (gate_up.abs() < 0.4).any()


def test_clamped_swiglu_defaults_are_gpt_oss():
    layer = make({"type": "top", "k": 2}, {"type": "clamped_swiglu", "hidden_size_per_expert": HIDDEN})
    experts = layer.experts
    assert (experts.alpha, experts.limit, experts.interleaved) == (1.702, 7.0, True)
    assert experts.gate_up_proj.shape == (9, MODEL_DIM, 2 * HIDDEN) and experts.down_proj_bias.shape == (9, MODEL_DIM)
    compare(layer, torch.randn(17, MODEL_DIM, dtype=torch.float64) * 20, {"renormalize": True}, k=2,
            capacity_factor=1.0, loss="gshard", expert_reference=clamped_reference)


@pytest.mark.parametrize("k", [1, 2])
def test_llama4_score_before_expert_with_shared_expert(k):
    """Llama 4: sigmoid of the chosen logit scales the token before its expert; a shared expert."""
    gate = {"type": "top", "k": k, "score_function": "sigmoid", "balance_loss": "none", "capacity_factor": 0.0}
    experts = {"type": "ffn", "hidden_size_per_expert": HIDDEN, "shared_experts": {"hidden_size": 7}}
    layer = make(gate, experts, num_experts=5, is_postscore=False, normalize_gate=False)
    compare(layer, torch.randn(2, 9, MODEL_DIM, dtype=torch.float64), dict(score_function="sigmoid"), k=k,
            capacity_factor=0.0, loss="none")


@pytest.mark.parametrize("k", [1, 4, 8])
def test_qwen2_moe_gated_shared_expert(k):
    """Qwen2-MoE: softmax top-k weights as they are, a shared expert gated by sigmoid(x . w)."""
    gate = {"type": "top", "k": k, "renormalize": False, "z_loss_weight": 0.1, "capacity_factor": capacity_for(k)}
    experts = {"type": "ffn", "hidden_size_per_expert": HIDDEN, "shared_experts": {"hidden_size": 8, "gated": True}}
    layer = make(gate, experts, num_experts=13)
    compare(layer, torch.randn(25, MODEL_DIM, dtype=torch.float64), {}, k=k, capacity_factor=capacity_for(k),
            loss="gshard", z_loss_weight=0.1)
