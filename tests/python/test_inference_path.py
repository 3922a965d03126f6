"""moe_layer's forward without autograd in one routing call and one experts call (the path
LAYER_IN_TWO_CALLS, routed by tutel.impls.layer_routing.route_in_one_pass): the routing function
against float64 sums of the same scores, and the layer against the float64 token-by-token reference, with the calls it must leave to the general
forward."""
import pytest
import torch

from layer_harness import run_and_compare
from test_gates_experts import llama_reference
from test_grouped_experts import make_layer
from tutel.impls import layer_paths
from tutel.ops.direct import route_without_grad


# One rounding of each dtype (float64: the float32 error of no step applies).
UNIT_ROUNDING = {torch.float64: 2.0 ** -52, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11}


def reference_routing(scores, k, normalize, capacity, batch_prioritized):
    """(ids [T, k] with dropped choices = E, weights [T, k] float64, dispatch [E], loss float64) of
    softmax scores: top-k with ties to the lower expert, GShard slots (every first choice before any
    second; tokens in order, or by descending top-1 score, ties in token order)."""
    tokens, experts = scores.shape
    s = scores.double()
    order = torch.sort(-s, dim=1, stable=True).indices[:, :k]  # best first, ties to the lower index
    gates = torch.gather(s, 1, order)
    dispatch = torch.bincount(order.flatten(), minlength=experts)
    ids = order.clone()
    if 0 <= capacity < tokens:
        claim = torch.sort(-gates[:, 0], stable=True).indices if batch_prioritized else torch.arange(tokens)
        used = [0] * experts
        for j in range(k):
            for t in claim.tolist():
                e = int(order[t, j])
                if used[e] >= capacity:
                    ids[t, j] = experts
                used[e] += 1
    weights = gates / gates.sum(dim=1, keepdim=True) if normalize and k > 1 else gates
    first = torch.bincount(order[:, 0], minlength=experts).double()
    loss = (s.mean(dim=0) * first / tokens).sum() * experts if tokens else torch.zeros((), dtype=torch.float64)
    return ids, weights, dispatch, loss


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,experts,k", [(0, 4, 2), (1, 1, 1), (1, 64, 8), (5, 7, 3), (37, 96, 6),
                                             (29, 16, 1), (50, 9, 4)])
@pytest.mark.parametrize("capacity", [-1, 0, 3, 1000])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("batch_prioritized", [False, True])
def test_routing_matches_float64(dtype, tokens, experts, k, capacity, normalize, batch_prioritized):
    generator = torch.Generator().manual_seed(tokens * 1000 + experts * 10 + k)
    logits = (torch.randn(tokens, experts, generator=generator) * 3).to(dtype)
    scores = torch.softmax(logits, dim=1)
    ids, weights, dispatch, loss = route_without_grad(scores, k, normalize, capacity, batch_prioritized)
    expected_ids, expected_weights, expected_dispatch, expected_loss = reference_routing(
        scores, k, normalize, capacity, batch_prioritized)
    assert ids.dtype == torch.int32 and weights.dtype == dtype and loss.dtype == dtype
    assert torch.equal(ids.long(), expected_ids)
    assert torch.equal(dispatch, expected_dispatch)
    unit = UNIT_ROUNDING[dtype]
    # the sum, the clamp and the division each rounded once; the loss: mean, share, product, sum, scale
    assert torch.allclose(weights.double(), expected_weights, rtol=3 * unit, atol=0)
    assert abs(float(loss) - float(expected_loss)) <= 6 * unit * abs(float(expected_loss)) + experts * unit


def test_routing_clamps_a_vanishing_gate_sum():
    """Gates whose sum underflows are divided by the dtype's eps, as normalize_gates clamps."""
    scores = torch.zeros(2, 4, dtype=torch.float32)
    scores[0] = torch.tensor([1e-30, 2e-30, 0.0, 0.0])
    scores[1] = torch.tensor([0.5, 0.25, 0.125, 0.125])
    _, weights, _, _ = route_without_grad(scores, 2, True, -1, False)
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(weights[0].double(), torch.tensor([2e-30 / eps, 1e-30 / eps], dtype=torch.float64),
                          rtol=1e-6)
    assert torch.allclose(weights[1], torch.tensor([2 / 3, 1 / 3]))


def test_routing_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k"):
        route_without_grad(torch.rand(3, 4), 5, True, -1, False)
    with pytest.raises((ValueError, TypeError), match="scores"):
        route_without_grad(torch.rand(3, 4, 2), 2, True, -1, False)


def record_fast_calls(monkeypatch):
    """Records a True for every call that routes in one pass (the path LAYER_IN_TWO_CALLS)."""
    taken = []
    original = layer_paths.route_in_one_pass

    def recording(*args, **kwargs):
        taken.append(True)
        return original(*args, **kwargs)
    monkeypatch.setattr(layer_paths, "route_in_one_pass", recording)
    return taken


@pytest.mark.parametrize("capacity_factor,batch_prioritized,normalize_gate", [
    (0.0, False, True), (0.5, False, True), (0.5, True, True), (0.5, True, False), (2.0, False, False)])
@pytest.mark.parametrize("experts,k,tokens", [(7, 3, 37), (64, 8, 21), (3, 1, 1), (5, 2, 0)])
def test_layer_without_grad_matches_reference(monkeypatch, capacity_factor, batch_prioritized, normalize_gate,
                                              experts, k, tokens):
    """llama_ffn inference takes the path (dropless, static capacities that drop, batch-prioritized
    slots, gates left unnormalized) and equals the float64 reference, output and l_aux."""
    taken = record_fast_calls(monkeypatch)
    torch.manual_seed(experts + 10 * tokens)
    layer = make_layer(experts, k, capacity_factor, hidden=11, expert_type="llama_ffn",
                       batch_prioritized_routing=batch_prioritized, normalize_gate=normalize_gate)
    capacity, kept = run_and_compare(
        layer, torch.randn(tokens, 10, dtype=torch.float64), forward_kwargs=dict(megablocks_size=1), top_k=k,
        capacity_factor=capacity_factor, no_grad=True, expert_reference=llama_reference,
        batch_prioritized=batch_prioritized, normalize_gate=normalize_gate)
    assert taken == [True]
    if capacity_factor == 0.5 and tokens == 37:
        assert not bool(kept.all()), "the case must drop choices"
    assert layer.dispatch_count.shape == (experts,) and int(layer.dispatch_count.sum()) == tokens * k


def test_bfloat16_layer_without_grad_matches_reference(monkeypatch):
    taken = record_fast_calls(monkeypatch)
    torch.manual_seed(3)
    layer = make_layer(8, 2, 0.0, dtype=torch.bfloat16, expert_type="llama_ffn")
    run_and_compare(layer, torch.randn(19, 10).to(torch.bfloat16), forward_kwargs=dict(megablocks_size=1), top_k=2,
                    capacity_factor=0.0, no_grad=True, use_layer_logits=True, tol=dict(rtol=2e-2, atol=2e-2),
                    expert_reference=llama_reference)
    assert taken == [True]


def test_calls_the_path_does_not_cover_take_the_general_forward(monkeypatch):
    """With autograd, autocast, a dynamic capacity, gate noise in training, the padded layout or experts
    without gated_weights the path is not entered; each call still equals what it computes anyway."""
    taken = record_fast_calls(monkeypatch)
    x = torch.randn(9, 10, dtype=torch.float64)
    layer = make_layer(4, 2, 0.0, expert_type="llama_ffn")
    layer(x, megablocks_size=1)  # autograd records
    with torch.no_grad():
        layer(x, megablocks_size=1, capacity_factor=-0.5)
        layer(x, megablocks_size=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x.float(), megablocks_size=1)
        make_layer(4, 2, 0.0, expert_type="ffn")(x, megablocks_size=1)
        noisy = make_layer(4, 2, 0.0, expert_type="llama_ffn")
        noisy.gates[0].gate_noise = 1.0
        noisy.train()
        noisy(x, megablocks_size=1)
        noisy.eval()
        noisy(x, megablocks_size=1)
    assert taken == [True]  # only the noisy gate's evaluation call
