"""Scored routing (score functions, selection bias, group-limited top-k, renormalisation, scaling,
z-loss, sequence-wise and global-batch losses), shared experts and clamped SwiGLU experts against
the float64 reference of reference_scored.py: outputs, l_aux and every gradient."""
import pytest
import torch

from scored_harness import HIDDEN, MODEL_DIM, capacity_for, clamped_reference, compare, make, randomize_bias

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
    experts = layer.experts
    gate_up = torch.einsum("tm,emi->tei", x, experts.gate_up_proj.detach()) + experts.gate_up_proj_bias.detach()
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


@pytest.mark.parametrize("k", [1, 8])
def test_many_experts_in_many_groups(k):
    """72 experts in 8 groups of 9, tokens limited to 3 groups; tight static capacity drops choices."""
    gate = {"type": "top", "k": k, "score_function": "sigmoid", "selection_bias": True, "n_group": 8,
            "topk_group": 3, "renormalize": True, "routed_scaling_factor": 2.5, "balance_loss": "sequence",
            "capacity_factor": 1.0}
    layer = make(gate, num_experts=72)
    bias = randomize_bias(layer, scale=0.1)
    _, kept = compare(layer, torch.randn(4, 10, MODEL_DIM, dtype=torch.float64),
                      dict(score_function="sigmoid", bias=bias, n_group=8, topk_group=3, renormalize=True, scale=2.5),
                      k=k, capacity_factor=1.0, loss="sequence", sequence_length=10)
    assert not all(all(row) for row in kept)  # some choices were dropped
