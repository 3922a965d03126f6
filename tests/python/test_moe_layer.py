"""moe_layer against the token-by-token float64 reference (reference_moe.py)."""
import pytest
import torch

from conftest import tolerance
from layer_harness import run_and_compare
from tutel import moe


def make_layer(experts, k, capacity_factor=1.0, model_dim=10, hidden=12, bias=True, dtype=torch.float64,
               gate_extra=None, **layer_kwargs):
    gate = {"type": "top", "k": k, "capacity_factor": capacity_factor, **(gate_extra or {})}
    layer = moe.moe_layer(gate_type=gate, model_dim=model_dim,
                          experts={"type": "ffn", "num_experts_per_device": experts,
                                   "hidden_size_per_expert": hidden, "has_fc1_bias": bias, "has_fc2_bias": bias},
                          **layer_kwargs)
    return layer.to(dtype)


@pytest.mark.parametrize("capacity_factor", [1.0, 0.5, 0.0, -0.6, 1.25])
@pytest.mark.parametrize("experts,k", [(1, 1), (1, 2), (2, 1), (2, 2), (7, 3), (5, 4), (64, 2), (16, 4)])
def test_matches_reference(experts, k, capacity_factor):
    layer = make_layer(experts, k, capacity_factor)
    x = torch.randn(3, 13, 10, dtype=torch.float64)  # odd token count, 3-D input
    capacity, kept = run_and_compare(layer, x, top_k=min(k, experts), capacity_factor=capacity_factor)
    if capacity_factor == 0:
        assert bool(kept.all())


@pytest.mark.parametrize("option", ["no_normalize", "prescore", "no_bias", "bpr_drops", "bpr_dropless",
                                    "bpr_capped"])
def test_layer_options(option):
    capacity_factor = {"bpr_drops": 0.5, "bpr_dropless": 0.0, "bpr_capped": -0.6}.get(option, 0.75)
    options = dict(normalize_gate=option != "no_normalize", is_postscore=option != "prescore")
    bpr = option.startswith("bpr")
    layer = make_layer(5, 2, capacity_factor, bias=option != "no_bias", batch_prioritized_routing=bpr, **options)
    x = torch.randn(41, 10, dtype=torch.float64)
    capacity, kept = run_and_compare(layer, x, top_k=2, capacity_factor=capacity_factor, batch_prioritized=bpr,
                                     **options)
    if option == "bpr_drops":
        assert not bool(kept.all())  # the test exercises dropping
    if option == "bpr_dropless":
        assert bool(kept.all())  # dynamic capacity stays right under batch-prioritized routing


def test_forward_switches_apply_per_call_only():
    layer = make_layer(6, 2, capacity_factor=1.0)
    x = torch.randn(29, 10, dtype=torch.float64)
    run_and_compare(layer, x, forward_kwargs=dict(top_k=3, capacity_factor=0.0), top_k=3, capacity_factor=0.0)
    assert layer.gates[0].top_k == 2 and layer.gates[0].capacity_factor == 1.0
    run_and_compare(layer, x, top_k=2, capacity_factor=1.0)  # back to the gate's settings
    run_and_compare(layer, x, forward_kwargs=dict(capacity_factor=-0.6, top_k=6), top_k=6, capacity_factor=-0.6)
    run_and_compare(layer, x, forward_kwargs=dict(a2a_ffn_overlap_degree=3, capacity_factor=0.5),
                    top_k=2, capacity_factor=0.5, alignment=3)
    assert layer.a2a_ffn_overlap_degree == 1
    run_and_compare(layer, x, forward_kwargs=dict(adaptive_r=0), top_k=2, capacity_factor=1.0)
    assert layer.adaptive_degree == 1
    run_and_compare(layer, x, forward_kwargs=dict(megablocks_size=4, capacity_factor=0.0), top_k=2,
                    capacity_factor=0.0, alignment=4)


def test_dispatch_count_and_attributes():
    layer = make_layer(4, 2, capacity_factor=0.5)
    x = torch.randn(50, 10, dtype=torch.float64)
    y = layer(x)
    assert layer.dispatch_count.shape == (4,) and int(layer.dispatch_count.sum()) == 100
    assert layer.l_aux is y.l_aux and layer.protected_shape[-1] == 10
    assert layer.megablocks_size == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp32_gate", [False, True])
def test_low_precision_matches_reference(dtype, fp32_gate):
    layer = make_layer(6, 2, capacity_factor=0.8, dtype=dtype, gate_extra={"fp32_gate": fp32_gate})
    assert layer.gates[0].wg.weight.dtype == (torch.float32 if fp32_gate else dtype)
    x = torch.randn(33, 10).to(dtype)
    tol = tolerance(dtype) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    run_and_compare(layer, x, top_k=2, capacity_factor=0.8, tol=tol, use_layer_logits=True)


def test_reserve_dims_two():
    layer = make_layer(3, 2, capacity_factor=0.0, model_dim=12)
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    y = layer(x, reserve_dims=2)
    assert y.shape == x.shape
    flat = layer(x.reshape(10, 12))
    torch.testing.assert_close(y.reshape(10, 12), flat)


def test_empty_and_single_token_batches():
    layer = make_layer(4, 2)
    for tokens in (0, 1):
        x = torch.randn(tokens, 10, dtype=torch.float64, requires_grad=True)
        for factor in (1.0, 0.0, -1.0):
            y = layer(x, capacity_factor=factor)
            assert y.shape == (tokens, 10)
            (y.sum() + y.l_aux).backward()
            assert x.grad.shape == x.shape


def test_multi_gate_selection():
    layer = moe.moe_layer(gate_type=[{"type": "top", "k": 1}, {"type": "top", "k": 2, "capacity_factor": 0.0}],
                          model_dim=10, experts={"type": "ffn", "num_experts_per_device": 4,
                                                 "hidden_size_per_expert": 8}).double()
    x = torch.randn(21, 10, dtype=torch.float64)
    run_and_compare(layer, x, top_k=1, capacity_factor=1.0)
    run_and_compare(layer, x, forward_kwargs=dict(gate_index=1), top_k=2, capacity_factor=0.0)


def test_autocast_cpu_bfloat16():
    layer = make_layer(4, 2, capacity_factor=0.0, dtype=torch.float32)
    x = torch.randn(40, 10)
    expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=5e-2, atol=5e-2)
    y.sum().backward()
    assert layer.experts.batched_fc1_w.grad is not None


def test_megablocks_training_matches_padded_path():
    layer = make_layer(5, 2, capacity_factor=0.0)
    x = torch.randn(60, 10, dtype=torch.float64)
    for block in (1, 3, 8):
        a = x.clone().requires_grad_()
        y_block = layer(a, megablocks_size=block)
        y_block.sum().backward()
        grads_block = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        b = x.clone().requires_grad_()
        y_plain = layer(b)
        y_plain.sum().backward()
        torch.testing.assert_close(y_block, y_plain)
        torch.testing.assert_close(a.grad, b.grad)
        for g, p in zip(grads_block, layer.parameters()):
            torch.testing.assert_close(g, p.grad)
        layer.zero_grad()
