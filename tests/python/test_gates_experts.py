"""Gates (top, cosine_top, custom), experts (ffn, llama_ffn, custom) and the auxiliary losses."""
import math

import pytest
import torch
import torch.nn.functional as F

import reference_moe
from conftest import tolerance
from layer_harness import float64_copy, run_and_compare
from tutel import moe


def cosine_gate_reference(gate):
    proj_w, proj_b = float64_copy(gate.cosine_projector.weight), float64_copy(gate.cosine_projector.bias)
    sim, temperature = float64_copy(gate.sim_matrix), float64_copy(gate.temperature)

    def logits(x64):
        projected = x64 @ proj_w.t() + proj_b
        cos = (projected / projected.norm(dim=1, keepdim=True).clamp_min(1e-12)) @ \
            (sim / sim.norm(dim=0, keepdim=True).clamp_min(1e-12))
        return cos * torch.exp(torch.clamp(temperature, max=math.log(100.0)))

    return logits, [(gate.cosine_projector.weight, proj_w), (gate.cosine_projector.bias, proj_b),
                    (gate.sim_matrix, sim), (gate.temperature, temperature)]


def test_cosine_top_gate():
    layer = moe.moe_layer(gate_type={"type": "cosine_top", "k": 2, "proj_dim": 6, "init_t": 0.3,
                                     "capacity_factor": 0.7},
                          model_dim=10, experts={"type": "ffn", "num_experts_per_device": 5,
                                                 "hidden_size_per_expert": 8}).double()
    gate = layer.gates[0]
    assert gate.temperature.shape == (1,) and gate.sim_matrix.shape == (6, 5)
    torch.testing.assert_close(gate.temperature, torch.log(torch.tensor([1 / 0.3], dtype=torch.float64)))
    run_and_compare(layer, torch.randn(31, 10, dtype=torch.float64), top_k=2, capacity_factor=0.7,
                    gate_reference=cosine_gate_reference)


def llama_reference(experts, activation=F.silu):
    names = ["W_fc1", "W_fc2", "W_fc3"]
    copies = [float64_copy(getattr(experts, n)) for n in names]
    shapes = [experts.full_shapes[n] for n in names]

    def expert_fn(e, h):
        w1, w2, w3 = (c.view(s)[e] for c, s in zip(copies, shapes))
        return (activation(h @ w1) * (h @ w2)) @ w3

    return expert_fn, [(getattr(experts, n), c) for n, c in zip(names, copies)]


def test_llama_ffn_experts():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2, "capacity_factor": 0.0}, model_dim=10,
                          experts={"type": "llama_ffn", "num_experts_per_device": 3,
                                   "hidden_size_per_expert": 7}).double()
    assert layer.experts.W_fc1.shape == (3 * 10 * 7,)
    run_and_compare(layer, torch.randn(25, 10, dtype=torch.float64), top_k=2, capacity_factor=0.0,
                    expert_reference=llama_reference)


@pytest.mark.parametrize("activation", [F.silu, F.gelu])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_llama_ffn_experts_fused_and_other_activations(activation, capacity_factor):
    """SiLU runs the fused gated unit over the two products; any other activation runs as given."""
    torch.manual_seed(3)
    layer = moe.moe_layer(gate_type={"type": "top", "k": 3, "capacity_factor": capacity_factor}, model_dim=12,
                          experts={"type": "llama_ffn", "num_experts_per_device": 5, "hidden_size_per_expert": 9,
                                   "activation_fn": activation}).double()
    run_and_compare(layer, torch.randn(41, 12, dtype=torch.float64), top_k=3, capacity_factor=capacity_factor,
                    expert_reference=lambda experts: llama_reference(experts, activation))


class ScaledGate(torch.nn.Module):
    """A custom gate as users write them: takes top_k, not k."""

    def __init__(self, model_dim, num_global_experts, top_k=1, scale=1.0):
        super().__init__()
        self.top_k = top_k
        self.scale = scale
        self.wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)

    def forward(self, x):
        return self.wg(x) * self.scale


class DoubleExpert(torch.nn.Module):
    """A custom expert: y = 2 * tanh(x @ W[e]) for each local expert."""

    def __init__(self, model_dim, num_experts_per_device, sharded_count, my_activ_type="tanh"):
        super().__init__()
        if sharded_count > 1:
            raise ValueError("this expert does not support sharding")
        self.weight = torch.nn.Parameter(torch.randn(num_experts_per_device, model_dim, model_dim) * 0.3)
        self.activation = getattr(torch, my_activ_type)

    def forward(self, x, ctx):
        assert ctx.num_global_experts == self.weight.shape[0]
        return 2 * self.activation(torch.matmul(x, self.weight))


def test_custom_gate_and_expert():
    layer = moe.moe_layer(gate_type={"type": "custom", "module": ScaledGate, "top_k": 2, "scale": 1.5},
                          model_dim=6, experts={"type": "custom", "module": DoubleExpert,
                                                "num_experts_per_device": 4, "my_activ_type": "tanh"}).double()
    gate = layer.gates[0]
    assert gate.capacity_factor == 1.0 and gate.gate_noise == 0.0

    def gate_ref(g):
        w = float64_copy(g.wg.weight)
        return (lambda x64: (x64 @ w.t()) * 1.5), [(g.wg.weight, w)]

    def expert_ref(m):
        w = float64_copy(m.weight)
        return (lambda e, h: 2 * torch.tanh(h @ w[e])), [(m.weight, w)]

    run_and_compare(layer, torch.randn(3, 7, 6, dtype=torch.float64), top_k=2, capacity_factor=1.0,
                    gate_reference=gate_ref, expert_reference=expert_ref)


class LegacyExpert(torch.nn.Module):
    def __init__(self, model_dim, local_experts, sharded_count):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(local_experts, model_dim, model_dim))

    def forward(self, x, ctx):
        return torch.matmul(x, self.weight)


def test_custom_expert_with_legacy_local_experts_argument():
    with pytest.warns(DeprecationWarning, match="local_experts"):
        layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=4,
                              experts={"type": "custom", "module": LegacyExpert, "count_per_node": 3})
    assert layer.experts.weight.shape == (3, 4, 4)
    assert layer(torch.randn(5, 4)).shape == (5, 4)


def test_gate_noise_in_training_only():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2, "gate_noise": 1.0, "capacity_factor": 0.0},
                          model_dim=10, experts={"type": "ffn", "num_experts_per_device": 6,
                                                 "hidden_size_per_expert": 8}).double()
    x = torch.randn(40, 10, dtype=torch.float64)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    torch.manual_seed(5)
    noisy = layer(x)
    torch.manual_seed(5)
    logits = layer.gates[0](x)
    noise = torch.randn_like(logits)
    # gates come from the noisy softmax: reproduce with the same noise draw
    expected, l_aux, _, _ = reference_moe.moe_forward(
        x, logits.detach() + 1.0 * noise / 6, lambda e, h: _ffn(layer, e, h), 2, 0.0)
    torch.testing.assert_close(noisy, expected)


def _ffn(layer, e, h):
    ex = layer.experts
    return reference_moe.ffn_expert([ex.batched_fc1_w.detach(), ex.batched_fc1_bias.detach(),
                                     ex.batched_fc2_w.detach(), ex.batched_fc2_bias.detach()], e, h, torch.relu)


def reference_load_importance(logits, noisy_logits, k, gate_noise):
    """Shazeer et al. (2017) written out with loops over tokens and experts."""
    tokens, experts = logits.shape
    probs = torch.softmax(logits, dim=1)
    importance = probs.sum(0)
    sigma = gate_noise / experts
    normal = torch.distributions.Normal(0.0, sigma)
    load = torch.zeros(experts, dtype=torch.float64)
    for t in range(tokens):
        for e in range(experts):
            others = torch.cat([noisy_logits[t, :e], noisy_logits[t, e + 1:]])
            threshold = torch.sort(others, descending=True).values[k - 1] if others.numel() >= k else \
                torch.tensor(-math.inf, dtype=torch.float64)
            load[e] = load[e] + normal.cdf(logits[t, e] - threshold)
    cv2 = lambda v: v.var() / (v.mean() ** 2 + 1e-10)
    return (cv2(importance) + cv2(load)) / 2


@pytest.mark.parametrize("k", [1, 2, 4])
def test_load_importance_loss(k):
    layer = moe.moe_layer(gate_type={"type": "top", "k": k, "gate_noise": 0.5}, model_dim=8,
                          experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 4},
                          is_gshard_loss=False).double()
    x = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(11)
    y = layer(x)
    y.l_aux.backward()

    x64, w64 = float64_copy(x), float64_copy(layer.gates[0].wg.weight)
    torch.manual_seed(11)  # the same noise as the layer drew
    logits = x64 @ w64.t()
    noisy = logits + 0.5 * torch.randn_like(logits) / 4
    expected = reference_load_importance(logits, noisy, k, 0.5)
    expected.backward()
    tol = tolerance(torch.float64)
    torch.testing.assert_close(y.l_aux, expected.detach(), **tol)
    torch.testing.assert_close(x.grad, x64.grad, **tol)
    torch.testing.assert_close(layer.gates[0].wg.weight.grad, w64.grad, **tol)


def test_load_importance_loss_needs_noise():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, is_gshard_loss=False,
                          experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 4})
    with pytest.raises(ValueError, match="gate_noise > 0"):
        layer(torch.randn(5, 8))
