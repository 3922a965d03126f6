"""moe_layer construction, state_dict compatibility and bad input."""
import logging
import warnings

import pytest
import torch

from tutel import moe


def ffn(count=2, hidden=8, **extra):
    return {"type": "ffn", "num_experts_per_device": count, "hidden_size_per_expert": hidden, **extra}


def test_state_dict_keys_and_shapes_match_tutel():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=6, experts=ffn(3, 10, output_dim=5))
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes == {
        "_num_global_experts": (),
        "experts.batched_fc1_w": (3, 10, 6),
        "experts.batched_fc2_w": (3, 10, 5),
        "experts.batched_fc1_bias": (3, 10),
        "experts.batched_fc2_bias": (3, 5),
        "gates.0.wg.weight": (3, 6),
    }
    no_bias = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=6,
                            experts=ffn(2, has_fc1_bias=False, has_fc2_bias=False))
    assert "experts.batched_fc1_bias" not in no_bias.state_dict()
    assert no_bias.experts.batched_fc1_bias is None


def test_checkpoint_round_trip():
    torch.manual_seed(0)
    source = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8, experts=ffn(4))
    torch.manual_seed(1)
    target = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8, experts=ffn(4))
    x = torch.randn(20, 8)
    assert not torch.equal(source(x), target(x))
    target.load_state_dict(source.state_dict())
    assert torch.equal(source(x), target(x))


def test_legacy_checkpoint_loads_with_a_warning(caplog):
    source = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(4))
    state = source.state_dict()
    del state["_num_global_experts"]
    target = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(4))
    with caplog.at_level(logging.WARNING, logger="tutel"):
        target.load_state_dict(state)
    assert "legacy format" in caplog.text
    x = torch.randn(5, 8)
    assert torch.equal(source(x), target(x))


def test_checkpoint_mismatches_are_clear():
    source = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(4))
    other = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(2))
    with pytest.raises(ValueError, match="number of global experts mismatch"):
        other.load_state_dict(source.state_dict())
    state = source.state_dict()
    state["experts.batched_fc1_w"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="batched_fc1_w.*does not fit"):
        moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(4)).load_state_dict(state)


def test_same_numel_reshape_and_missing_expert_params(caplog):
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(4))
    state = layer.state_dict()
    state["experts.batched_fc1_w"] = state["experts.batched_fc1_w"].reshape(1, 4, 8, 8)
    del state["experts.batched_fc2_bias"]
    target = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(4))
    with caplog.at_level(logging.WARNING, logger="tutel"):
        target.load_state_dict(state)
    assert "zero values will be filled" in caplog.text
    assert torch.equal(target.experts.batched_fc1_w, layer.experts.batched_fc1_w)
    assert torch.equal(target.experts.batched_fc2_bias, torch.zeros(4, 8))


def test_seeds_make_initialisation_reproducible():
    make = lambda seeds: moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8, experts=ffn(2), seeds=seeds)
    a, b, c = make((1, 2, 3)), make((1, 2, 3)), make((1, 5, 3))
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if name.startswith("experts."):
            assert not torch.equal(pa, pc), name
        else:
            assert torch.equal(pa, pc), name


def test_scan_expert_func_and_expert_marker():
    seen = []
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8, experts=ffn(2),
                          scan_expert_func=lambda name, p: (seen.append(name), setattr(p, "skip_allreduce", True)))
    assert sorted(seen) == sorted(n for n, _ in layer.experts.named_parameters())
    assert all(getattr(p, "_tutel_expert", False) and p.skip_allreduce for p in layer.experts.parameters())
    assert not any(hasattr(p, "_tutel_expert") for p in layer.gates.parameters())
    assert [n for n, _ in layer.get_parameter_iterator("gate")] == ["0.wg.weight"]
    with pytest.raises(ValueError, match="gate, local_experts"):
        layer.get_parameter_iterator("bogus")


def test_configuration_dicts_are_not_modified_and_can_be_reused():
    gate = {"type": "top", "k": 2, "capacity_factor": 0.5}
    experts = ffn(2)
    gate_copy, experts_copy = dict(gate), dict(experts)
    first = moe.moe_layer(gate_type=gate, model_dim=8, experts=experts)
    second = moe.moe_layer(gate_type=gate, model_dim=8, experts=experts)
    assert gate == gate_copy and experts == experts_copy
    assert first.gates[0].capacity_factor == second.gates[0].capacity_factor == 0.5


def test_legacy_gate_string_and_count_per_node():
    with pytest.warns(DeprecationWarning, match="Top2Gate"):
        layer = moe.moe_layer(gate_type="Top2Gate", model_dim=8,
                              experts={"type": "ffn", "count_per_node": 3, "hidden_size_per_expert": 4})
    assert layer.gates[0].top_k == 2 and layer.num_global_experts == 3
    assert "Top-K(s) = ['k=2, noise=0.0'], Total-Experts = 3 [managed by 1 device(s)]," in repr(layer)
    with pytest.warns(DeprecationWarning, match="pad_samples"):
        moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(1), pad_samples=True)


def test_gate_k_is_reduced_to_expert_count_with_a_warning_and_env_defaults(monkeypatch):
    for gate_type in ("top", "cosine_top"):
        with pytest.warns(UserWarning, match=r"gate_type: k=4 exceeds num_global_experts=2 \(allowed: 1 <= k <= 2\); "
                                             r"the gate uses k=2"):
            layer = moe.moe_layer(gate_type={"type": gate_type, "k": 4}, model_dim=8, experts=ffn(2))
        assert layer.gates[0].top_k == 2
    monkeypatch.setenv("CAP_FACTOR", "0.25")
    assert moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(2)).gates[0].capacity_factor == 0.25
    monkeypatch.setenv("CAP_FACTOR", "abc")
    with pytest.raises(ValueError, match="CAP_FACTOR='abc' must be a finite number"):
        moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(2))


@pytest.mark.parametrize("option, error, match", [
    # the gate dict's values get the rules and messages of forward's switches (test_forward_bad_input)
    ({"k": "two"}, TypeError, "gate_type: `k` must be an integer, got str"),
    ({"k": 1.5}, TypeError, "gate_type: `k` must be an integer, got float"),
    ({"k": 0}, ValueError, "gate_type: `k` must be >= 1, got 0"),
    ({"capacity_factor": "abc"}, TypeError, "gate_type: `capacity_factor` must be a number, got str"),
    ({"capacity_factor": float("inf")}, ValueError, "gate_type: `capacity_factor` must be a finite number"),
    ({"gate_noise": "abc"}, TypeError, "gate_type: `gate_noise` must be a number, got str"),
    ({"gate_noise": -0.5}, ValueError, "gate_type: `gate_noise` must be >= 0"),
])
def test_gate_dict_bad_values_name_the_option(option, error, match):
    with pytest.raises(error, match=match):
        moe.moe_layer(gate_type={"type": "top", "k": 1, **option}, model_dim=8, experts=ffn(2))


def test_per_call_switch_and_gate_option_share_the_rule():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(2))
    with pytest.raises(TypeError, match="moe_layer.forward: `top_k` must be an integer, got str"):
        layer(torch.randn(3, 8), top_k="two")
    with pytest.raises(TypeError, match="moe_layer.forward: `capacity_factor` must be a number, got str"):
        layer(torch.randn(3, 8), capacity_factor="abc")


def test_tokens_of_another_dtype_are_computed_in_the_layers_dtype_with_a_warning():
    torch.manual_seed(3)
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=8, experts=ffn(2))  # float32
    x = torch.randn(5, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match="the input is torch.float64 but the experts' parameters are torch.float32; "
                                         "the layer computes in torch.float32 and returns torch.float64"):
        y = layer(x)
    assert y.dtype == torch.float64
    # computed in float32: exactly the float32 call's values, widened
    torch.testing.assert_close(y, layer(x.float()).double(), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x.float())  # the layer's own dtype: no warning
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x.float())  # autocast chooses the dtype: no warning either


def test_fp32_gate_stays_float32():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2, "fp32_gate": True}, model_dim=8, experts=ffn(2))
    layer = layer.bfloat16()
    assert layer.gates[0].wg.weight.dtype == torch.float32
    assert layer.experts.batched_fc1_w.dtype == torch.bfloat16
    y = layer(torch.randn(6, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


def test_default_activation_is_relu():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=4, experts=ffn(1, 4)).double()
    x = torch.randn(7, 4, dtype=torch.float64)
    e = layer.experts
    h = torch.relu(x @ e.batched_fc1_w[0].t() + e.batched_fc1_bias[0]) @ e.batched_fc2_w[0] + e.batched_fc2_bias[0]
    torch.testing.assert_close(layer(x), h)  # one expert, k = 1: gate value 1


def test_skip_moe_returns_the_input(monkeypatch):
    monkeypatch.setenv("SKIP_MOE", "1")
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=4, experts=ffn(2),
                          result_func=lambda out: (out, out.l_aux))
    x = torch.randn(3, 4)
    out, l_aux = layer(x)
    assert torch.equal(out, x) and l_aux is None and not hasattr(x, "l_aux")


def test_result_func():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=4, experts=ffn(2),
                          result_func=lambda out: (out, out.l_aux))
    out, l_aux = layer(torch.randn(3, 4))
    assert out.shape == (3, 4) and l_aux.dim() == 0


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(capacity_factor=1.0), ValueError, "capacity_factor — it belongs in the gate dict"),
    (dict(foo=1), ValueError, "Unrecognized argument provided to Tutel Moe-layer: foo"),
    (dict(parallel_type="bogus"), ValueError, "Unrecognized parallel type"),
    (dict(parallel_type="adaptive:x"), ValueError, "adaptive:<int>"),
    (dict(a2a_ffn_overlap_degree=0), ValueError, "a2a_ffn_overlap_degree"),
    (dict(model_dim=0), ValueError, "model_dim"),
    (dict(experts=None), ValueError, "needs `experts`"),
    (dict(experts={"type": "nope"}), ValueError, "Builtin expert type is not recognized"),
    (dict(experts={"type": "ffn", "num_experts_per_device": 0, "hidden_size_per_expert": 4}), ValueError,
     "num_experts_per_device=0"),
    (dict(experts={"type": "ffn", "hidden_size_per_expert": 4, "bogus": 1}), TypeError, "bogus"),
    (dict(gate_type={"type": "top", "k": 1, "batch_prioritized_routing": True}), ValueError,
     "argument of moe_layer"),
    (dict(gate_type={"type": "top", "k": 0}), ValueError, "gate_type: `k` must be >= 1, got 0"),
    (dict(gate_type={"type": "nope"}), ValueError, "Unrecognized gate_type"),
    (dict(gate_type="Top2"), ValueError, "Unrecognized gate_type"),
    (dict(gate_type=[]), ValueError, "non-empty list"),
])
def test_constructor_bad_input(kwargs, error, match):
    args = dict(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(2))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        moe.moe_layer(**args)


@pytest.mark.parametrize("call,error,match", [
    (lambda l: l(torch.randn(5, 7)), ValueError, "model_dim is 8"),
    (lambda l: l(torch.randn(8)), ValueError, "at least 2 dims"),
    (lambda l: l(torch.ones(5, 8, dtype=torch.int64)), TypeError, "floating-point"),
    (lambda l: l([1, 2]), TypeError, "torch.Tensor"),
    (lambda l: l(torch.randn(5, 8), top_k=0), ValueError, "top_k"),
    (lambda l: l(torch.randn(5, 8), top_k=3), ValueError, "top_k=3 exceeds num_global_experts=2"),
    (lambda l: l(torch.randn(5, 8), gate_index=1), ValueError, "gate_index=1 is out of range"),
    (lambda l: l(torch.randn(5, 2, 8), reserve_dims=2), ValueError, "hold 16 features.*model_dim is 8"),
    (lambda l: l(torch.randn(5, 8), reserve_dims=3), ValueError, "reserve_dims=3 is too large"),
    (lambda l: l(torch.randn(5, 8), capacity_factor=float("nan")), ValueError, "capacity_factor"),
    (lambda l: l(torch.randn(5, 8), adaptive_r=2), ValueError, "adaptive_r=2 is not valid"),
    (lambda l: l(torch.randn(5, 8), a2a_ffn_overlap_degree=0), ValueError, "a2a_ffn_overlap_degree"),
    (lambda l: l(torch.randn(5, 8), megablocks_size=-1), ValueError, "megablocks_size"),
])
def test_forward_bad_input(call, error, match):
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(2))
    with pytest.raises(error, match=match):
        call(layer)


def test_custom_gate_with_wrong_logits_shape():
    class BadGate(torch.nn.Module):
        top_k = 1

        def __init__(self, model_dim, num_global_experts):
            super().__init__()

        def forward(self, x):
            return x[:, :3]

    layer = moe.moe_layer(gate_type={"type": "custom", "module": BadGate}, model_dim=8, experts=ffn(2))
    with pytest.raises(ValueError, match="expected \\[tokens, num_global_experts\\]"):
        layer(torch.randn(4, 8))


def test_overlap_degree_beyond_the_capacity():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=8, experts=ffn(4))
    with pytest.raises(ValueError, match="a2a_ffn_overlap_degree=8 exceeds this call's capacity of 2"):
        layer(torch.randn(8, 8), a2a_ffn_overlap_degree=8)
    assert layer(torch.randn(8, 8), a2a_ffn_overlap_degree=2).shape == (8, 8)
    assert layer(torch.randn(0, 8), a2a_ffn_overlap_degree=8).shape == (0, 8)  # empty batch: nothing to split
