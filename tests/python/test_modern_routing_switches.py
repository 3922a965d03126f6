"""Scored routing with the rest of the layer: the selection-bias update rule over several steps,
state_dict and checkpoint resharding, per-call switches, low precision and autocast,
torch.compile, and the errors for contradictory options."""
import pytest
import torch

from conftest import require_fullgraph_tensor_attributes
import reference_scored as ref
from scored_harness import HIDDEN, MODEL_DIM, clamped_reference, compare, make, randomize_bias
from tutel import checkpoint, moe
from tutel.experts import ClampedSwiGLUExperts

DEEPSEEK = {"type": "top", "score_function": "sigmoid", "selection_bias": True, "n_group": 4, "topk_group": 2,
            "routed_scaling_factor": 2.0, "balance_loss": "sequence"}
DEEPSEEK_ROUTE = dict(score_function="sigmoid", n_group=4, topk_group=2, scale=2.0)


def test_bias_update_rule_over_several_steps_with_accumulation():
    """b += rate * sign(mean load - load) from the choices of every training call since the last update
    (two micro-batches per step, capacity drops included); eval calls count nothing."""
    rate, experts, k = 0.05, 7, 2
    layer = make({"type": "top", "k": k, "score_function": "sigmoid", "selection_bias": True,
                  "bias_update_rate": rate, "balance_loss": "none", "capacity_factor": 0.5}, num_experts=experts)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    expected = [0.0] * experts
    for step in range(6):
        loads = [0] * experts
        for _micro in range(2):
            x = torch.randn(13, MODEL_DIM, dtype=torch.float64) + 0.5  # a shared offset makes loads uneven
            layer(x).square().sum().backward()
            logits = x @ layer.gates[0].wg.weight.detach().t()
            for t in range(x.shape[0]):
                for e in ref.route_token(logits[t], k, score_function="sigmoid", bias=expected)[0]:
                    loads[e] += 1
        optimizer.step()
        optimizer.zero_grad()
        assert layer.gates[0].selection_bias.load.tolist() == loads
        assert layer.update_selection_bias() == 1
        expected = ref.bias_step(expected, loads, rate)
        torch.testing.assert_close(layer.gates[0].selection_bias.bias, torch.tensor(expected, dtype=torch.float64),
                                   rtol=0, atol=1e-12)
        assert layer.gates[0].selection_bias.load.tolist() == [0] * experts
    assert any(b != 0 for b in expected)
    layer.eval()
    layer(torch.randn(5, MODEL_DIM, dtype=torch.float64))
    assert layer.gates[0].selection_bias.load.tolist() == [0] * experts


def test_update_selection_biases_walks_the_model():
    with_bias = dict(DEEPSEEK, k=2)
    first = make([with_bias, {"type": "top", "k": 1}], num_experts=8)
    second = make([with_bias, with_bias], num_experts=8)
    plain = make({"type": "top", "k": 2}, num_experts=8)
    model = torch.nn.ModuleList([first, second, plain])
    assert moe.update_selection_biases(model) == 3
    assert plain.update_selection_bias() == 0


def test_state_dict_holds_the_bias_not_the_counts():
    layer = make(dict(DEEPSEEK, k=3), {"type": "ffn", "hidden_size_per_expert": HIDDEN,
                                       "shared_experts": {"hidden_size": 4, "gated": True}}, num_experts=8)
    bias = randomize_bias(layer)
    layer(torch.randn(9, MODEL_DIM, dtype=torch.float64))
    state = layer.state_dict()
    assert torch.equal(state["gates.0.selection_bias.bias"], bias)
    assert not any(key.endswith(".load") for key in state)
    assert {"shared_experts.gate_proj.weight", "shared_experts.gate.weight"} <= set(state)
    fresh = make(dict(DEEPSEEK, k=3), {"type": "ffn", "hidden_size_per_expert": HIDDEN,
                                       "shared_experts": {"hidden_size": 4, "gated": True}}, num_experts=8)
    fresh.load_state_dict(state)
    x = torch.randn(2, 5, MODEL_DIM, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)
    # Tutel's own layers keep exactly Tutel's keys
    plain = make({"type": "top", "k": 2}, num_experts=8).state_dict()
    assert set(plain) == {"_num_global_experts", "gates.0.wg.weight", "experts.batched_fc1_w", "experts.batched_fc2_w",
                          "experts.batched_fc1_bias", "experts.batched_fc2_bias"}


def test_checkpoint_resharding_keeps_bias_shared_experts_and_clamped_experts():
    experts = {"type": "clamped_swiglu", "hidden_size_per_expert": HIDDEN, "shared_experts": {"hidden_size": 4}}
    layer = make(dict(DEEPSEEK, k=2), experts, num_experts=8)
    randomize_bias(layer)
    state = layer.state_dict()
    parts = checkpoint.scatter_state_dict(state, 4)
    for part in parts:
        assert part["experts.gate_up_proj"].shape == (2, MODEL_DIM, 2 * HIDDEN)
        assert torch.equal(part["gates.0.selection_bias.bias"], state["gates.0.selection_bias.bias"])
        assert torch.equal(part["shared_experts.down_proj.weight"], state["shared_experts.down_proj.weight"])
    merged = checkpoint.gather_state_dicts(checkpoint.reshard_state_dicts(parts, 2))
    assert set(merged) == set(state)
    for key, value in state.items():
        assert torch.equal(merged[key], value), key


def test_per_call_switches_with_scored_routing():
    """gate_index, top_k, capacity_factor, a2a_ffn_overlap_degree and megablocks_size per call."""
    layer = make([{"type": "top", "k": 2}, dict(DEEPSEEK, k=3)],
                 {"type": "clamped_swiglu", "hidden_size_per_expert": HIDDEN}, num_experts=12)
    bias = randomize_bias(layer, gate_index=1)
    route = dict(DEEPSEEK_ROUTE, bias=bias)
    x = torch.randn(4, 6, MODEL_DIM, dtype=torch.float64)
    for top_k, capacity_factor, overlap, megablocks in [(None, 1.0, 1, 0), (5, 0.5, 2, 0), (1, 0.0, 1, 2),
                                                        (6, -2.0, 1, 0), (4, 0.0, 3, 0)]:
        k = 3 if top_k is None else top_k
        block = max(megablocks, 1)  # capacities are rounded up to whole overlap chunks and blocks
        compare(layer, x, dict(route, renormalize=k > 1), k=k, capacity_factor=capacity_factor, loss="sequence",
                sequence_length=6, expert_reference=clamped_reference, gate_index=1,
                alignment=-(-overlap // block) * block,
                forward_kwargs=dict(top_k=top_k, capacity_factor=capacity_factor, a2a_ffn_overlap_degree=overlap,
                                    megablocks_size=megablocks))
    # gate 0 still routes as Tutel does
    compare(layer, x, dict(renormalize=True), k=2, capacity_factor=1.0, loss="gshard",
            expert_reference=clamped_reference, gate_index=0)
    with pytest.raises(ValueError, match=r"k=7 exceeds the 6 experts of the topk_group=2 groups"):
        layer(x, gate_index=1, top_k=7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_keeps_a_float32_bias(dtype):
    layer = moe.moe_layer(gate_type=dict(DEEPSEEK, k=2, fp32_gate=True), model_dim=MODEL_DIM,
                          experts={"type": "clamped_swiglu", "num_experts_per_device": 8, "hidden_size_per_expert": 4,
                                   "shared_experts": {"hidden_size": 4}}).to(dtype)
    assert layer.gates[0].selection_bias.bias.dtype == torch.float32
    assert layer.gates[0].wg.weight.dtype == torch.float32
    x = torch.randn(3, 5, MODEL_DIM, dtype=dtype, requires_grad=True)
    y = layer(x)
    (y.float().sum() + y.l_aux).backward()
    assert y.dtype == dtype and torch.isfinite(y.float()).all() and torch.isfinite(x.grad.float()).all()


def test_autocast_matches_float32_within_bfloat16_tolerance():
    torch.manual_seed(7)
    layer = moe.moe_layer(gate_type=dict(DEEPSEEK, k=3, fp32_gate=True), model_dim=MODEL_DIM,
                          experts={"type": "clamped_swiglu", "num_experts_per_device": 8, "hidden_size_per_expert": 4,
                                   "shared_experts": {"hidden_size": 4, "gated": True}})
    randomize_bias(layer)
    x = torch.randn(2, 7, MODEL_DIM).bfloat16().float()  # the same tokens in both precisions
    expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    torch.testing.assert_close(y.float(), expected, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(y.l_aux.float(), expected.l_aux, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("balance_loss", ["sequence", "global_batch"])
def test_torch_compile_fullgraph_matches_eager(balance_loss):
    require_fullgraph_tensor_attributes()
    torch.manual_seed(3)
    gate = dict(DEEPSEEK, k=3, capacity_factor=1.25, z_loss_weight=0.01, balance_loss=balance_loss)
    experts = {"type": "clamped_swiglu", "num_experts_per_device": 8, "hidden_size_per_expert": 6,
               "shared_experts": {"hidden_size": 4, "gated": True}}
    layer = moe.moe_layer(gate_type=gate, model_dim=MODEL_DIM, experts=experts)
    randomize_bias(layer)
    x = torch.randn(2, 9, MODEL_DIM, requires_grad=True)
    expected = layer(x)
    (expected.sum() + expected.l_aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    eager_load = layer.gates[0].selection_bias.load.clone()
    layer.gates[0].selection_bias.load.zero_()
    layer.zero_grad()
    x_grad, x.grad = x.grad.clone(), None

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    (y.sum() + y.l_aux).backward()
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(y.l_aux, expected.l_aux)
    torch.testing.assert_close(x.grad, x_grad)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], msg=name)
    assert torch.equal(layer.gates[0].selection_bias.load, eager_load)


BAD_GATES = [
    ({"score_function": "tanh"}, "score_function='tanh' is not allowed: allowed: softmax, sigmoid, sqrt_softplus"),
    ({"n_group": 3, "topk_group": 1}, "n_group=3 is not allowed: it must divide the 8 experts"),
    ({"n_group": 4, "topk_group": 5}, "topk_group=5 is not allowed: it must be <= n_group=4"),
    ({"n_group": 4}, "topk_group is missing"),
    ({"topk_group": 2}, "n_group is missing"),
    ({"n_group": 4, "topk_group": 1, "k": 3}, "k=3 exceeds the 2 experts of the topk_group=1 groups"),
    ({"n_group": 0, "topk_group": 1}, "n_group=0 is not allowed"),
    ({"softmax_after_topk": True, "score_function": "sigmoid"}, "softmax_after_topk=True"),
    ({"bias_update_rate": 0.01}, "bias_update_rate needs selection_bias=True"),
    ({"selection_bias": True, "bias_update_rate": -1.0}, "bias_update_rate=-1.0 is not allowed"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor=0 is not allowed"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor=nan is not allowed"),
    ({"balance_loss": "switch"}, "balance_loss='switch' is not allowed"),
    ({"balance_loss": "load_importance", "score_function": "sigmoid"}, "balance_loss='load_importance'"),
    ({"z_loss_weight": -0.1}, "z_loss_weight=-0.1 is not allowed"),
    ({"renormalize": "yes"}, "renormalize='yes' is not allowed"),
]


@pytest.mark.parametrize("options, message", BAD_GATES, ids=[m.split(" ")[0] for _, m in BAD_GATES])
def test_contradictory_gate_options_name_the_option(options, message):
    gate = dict({"type": "top", "k": 1}, **options)
    with pytest.raises(ValueError) as error:
        make(gate, num_experts=8)
    assert message in str(error.value)


def test_bad_expert_options_name_the_option():
    cases = [({"type": "ffn", "hidden_size_per_expert": 4, "shared_experts": {"hidden_size": 0}},
              "shared_experts['hidden_size']=0 is not allowed"),
             ({"type": "ffn", "hidden_size_per_expert": 4, "shared_experts": {"size": 4}}, "unknown key(s) ['size']"),
             ({"type": "ffn", "hidden_size_per_expert": 4, "output_dim": 3, "shared_experts": {"hidden_size": 4}},
              "contradicts output_dim=3"),
             ({"type": "clamped_swiglu", "hidden_size_per_expert": 4, "limit": -1}, "limit=-1 is not allowed")]
    for experts, message in cases:
        with pytest.raises(ValueError) as error:
            make({"type": "top", "k": 1}, experts, num_experts=4)
        assert message in str(error.value), str(error.value)
    with pytest.raises(ValueError, match="'clamped_swiglu' keeps whole experts"):
        ClampedSwiGLUExperts(model_dim=4, hidden_size_per_expert=4, num_experts_per_device=1, sharded_count=2)


def test_load_importance_loss_needs_softmax_scores():
    layer = make({"type": "top", "k": 2, "score_function": "sigmoid", "gate_noise": 1.0}, num_experts=4,
                 is_gshard_loss=False)
    with pytest.raises(ValueError, match="is_gshard_loss=False.*score_function='sigmoid'"):
        layer(torch.randn(5, MODEL_DIM, dtype=torch.float64))


@pytest.mark.parametrize("balance_loss", ["sequence", "global_batch", "gshard", "none"])
def test_empty_and_one_token_batches(balance_loss):
    for capacity_factor in (1.0, 0.0, -1.0):
        layer = make(dict(DEEPSEEK, k=3, balance_loss=balance_loss, capacity_factor=capacity_factor, z_loss_weight=0.1),
                     {"type": "clamped_swiglu", "hidden_size_per_expert": HIDDEN,
                      "shared_experts": {"hidden_size": 4, "gated": True}}, num_experts=8)
        for shape in [(0, MODEL_DIM), (2, 0, MODEL_DIM)]:
            x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
            y = layer(x)
            (y.sum() + y.l_aux).backward()
            assert y.shape == x.shape and float(y.l_aux.detach()) == 0.0
        bias = randomize_bias(layer)
        compare(layer, torch.randn(1, 1, MODEL_DIM, dtype=torch.float64),
                dict(DEEPSEEK_ROUTE, bias=bias, renormalize=True),
                k=3, capacity_factor=capacity_factor, loss=balance_loss, z_loss_weight=0.1, sequence_length=1,
                expert_reference=clamped_reference)


def test_load_importance_loss_with_scored_routing():
    from test_gates_experts import reference_load_importance
    layer = make({"type": "top", "k": 2, "gate_noise": 0.5, "renormalize": False, "routed_scaling_factor": 3.0},
                 num_experts=5, is_gshard_loss=False)
    x = torch.randn(17, MODEL_DIM, dtype=torch.float64)
    torch.manual_seed(11)
    y = layer(x)
    torch.manual_seed(11)
    logits = x @ layer.gates[0].wg.weight.detach().t()
    noisy = logits + 0.5 * torch.randn_like(logits) / 5
    torch.testing.assert_close(y.l_aux.double(), reference_load_importance(logits, noisy, 2, 0.5), rtol=1e-5, atol=1e-7)


class CustomGate(torch.nn.Module):
    def __init__(self, model_dim, num_global_experts, top_k=1):
        super().__init__()
        self.top_k = top_k
        self.wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)

    def forward(self, x):
        return self.wg(x)


def test_custom_gate_takes_the_scored_routing_options():
    layer = make(dict(DEEPSEEK, type="custom", module=CustomGate, top_k=2), num_experts=8)
    bias = randomize_bias(layer)
    compare(layer, torch.randn(3, 5, MODEL_DIM, dtype=torch.float64), dict(DEEPSEEK_ROUTE, bias=bias, renormalize=True),
            k=2, capacity_factor=1.0, loss="sequence", sequence_length=5)
