"""The path chooser (tutel.rules.paths): its rules, the table docs/design.md shows, and the paths the
layer and routed_experts take for calls of each kind."""
import pathlib

import pytest
import torch
import torch.nn.functional as F

from tutel import moe
from tutel.experts import routed as routed_module
from tutel.experts.routed import routed_experts
from tutel.impls import layer_paths
from tutel.rules import paths
from tutel.rules.paths import EXPERTS, LAYER, Path, choose_path

DESIGN = pathlib.Path(__file__).resolve().parents[2] / "docs" / "design.md"


def _between(text, start, end):
    return text[text.index(start) + len(start):text.index(end)].strip()


def test_docs_show_the_rules_as_they_are():
    text = DESIGN.read_text(encoding="utf-8")
    assert _between(text, "<!-- path table -->", "<!-- /path table -->") == paths.path_table()
    assert _between(text, "<!-- path facts -->", "<!-- /path facts -->") == paths.facts_table()


def test_every_entry_ends_in_a_rule_without_conditions():
    for entry in paths.ENTRIES:
        last = [rule for rule in paths.RULES if rule.entry == entry][-1]
        assert last.when == ()
        assert choose_path(entry, {}).path is last.path


def test_an_unknown_entry_or_fact_is_refused():
    with pytest.raises(ValueError, match="entry must be one of"):
        choose_path("neither", {})
    with pytest.raises(KeyError, match="unknown fact"):
        paths._rule(LAYER, Path.PADDED, "x", colour="red")


CPU_INFERENCE = dict(device="cpu", gradient=False, traced=False, plain=True, autocast=False, processes="one",
                     layout="grouped", capacity="dropless", tutel_routing=True, gate_at_combine=True,
                     token_dims="one", gated_experts=True, experts_in_pieces=True, experts_grouped=True,
                     rows_fit_one_call=True)


@pytest.mark.parametrize("change, expected", [
    ({}, Path.LAYER_IN_TWO_CALLS),
    ({"processes": "several"}, Path.EXPERT_PARALLEL),
    ({"plain": False}, Path.GROUPED_ONE_CALL),              # a dispatch mode sees every operator
    ({"capacity": "capped"}, Path.GROUPED_ONE_CALL),
    ({"tutel_routing": False}, Path.GROUPED_ONE_CALL),
    ({"rows_fit_one_call": False}, Path.GROUPED_PIECES),
    ({"gated_experts": False}, Path.GROUPED_PIECES),
    ({"gradient": True}, Path.GROUPED),
    ({"traced": True}, Path.GROUPED),
    ({"device": "cuda"}, Path.STATIC_GROUPED),
    ({"device": "cuda", "decode_kernel": True}, Path.STATIC_DECODE),
    ({"device": "cuda", "decode_kernel": True, "gradient": True}, Path.STATIC_GROUPED),
    ({"device": "cuda", "decode_kernel": True, "capacity": "static"}, Path.STATIC_GROUPED),
    ({"device": "cuda", "decode_kernel": True, "gated_experts": False}, Path.STATIC_GROUPED),
    ({"device": "cuda", "capacity": "static", "layout": "padded"}, Path.STATIC_GROUPED),
    ({"device": "cuda", "capacity": "capped"}, Path.GROUPED),
    ({"device": "cuda", "tutel_routing": False}, Path.GROUPED),
    ({"device": "cuda", "experts_in_pieces": False}, Path.GROUPED),
    ({"device": "cuda", "token_dims": "several"}, Path.GROUPED),
    ({"device": "cuda", "processes": "several"}, Path.EXPERT_PARALLEL),
    ({"gate_at_combine": False}, Path.GROUPED),
    ({"layout": "padded"}, Path.PADDED),
    ({"gradient": True, "experts_grouped": False}, Path.PADDED),
])
def test_layer_rules(change, expected):
    assert choose_path(LAYER, {**CPU_INFERENCE, **change}).path is expected


@pytest.mark.parametrize("change, expected", [
    ({}, Path.EXPERTS_ONE_CALL),
    ({"gated_experts": False}, Path.EXPERTS_PIECES),
    ({"rows_fit_one_call": False}, Path.EXPERTS_PIECES),
    ({"gradient": True}, Path.EXPERTS_GROUPED),
    ({"traced": True}, Path.EXPERTS_GROUPED),
    ({"device": "cuda"}, Path.EXPERTS_GROUPED),
    ({"device": "cuda", "decode_kernel": True}, Path.EXPERTS_DECODE),
    ({"device": "cuda", "decode_kernel": True, "gradient": True}, Path.EXPERTS_GROUPED),
    ({"device": "cuda", "decode_kernel": True, "gated_experts": False}, Path.EXPERTS_GROUPED),
])
def test_experts_rules(change, expected):
    facts = dict(device="cpu", gradient=False, traced=False, gated_experts=True, rows_fit_one_call=True)
    assert choose_path(EXPERTS, {**facts, **change}).path is expected


def _llama_layer(activation=F.silu, k=2):
    torch.manual_seed(0)
    return moe.moe_layer(gate_type={"type": "top", "k": k}, model_dim=16,
                         experts={"type": "llama_ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8,
                                  "activation_fn": activation})


def _ran_path(monkeypatch, layer, x, **switches):
    """The path a real call takes (run_path spied on) and the layer's own prediction of it."""
    taken = []
    original = layer_paths.run_path

    def spy(path, *args, **kwargs):
        taken.append(path)
        return original(path, *args, **kwargs)

    monkeypatch.setattr("tutel.impls.moe_layer.run_path", spy)
    predicted = layer.choose_path(x, **switches)
    layer(x, **switches)
    assert taken == [predicted.path]
    return predicted.path


def test_layer_calls_take_the_path_the_facts_name(monkeypatch):
    layer = _llama_layer()
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert _ran_path(monkeypatch, layer, x, megablocks_size=1) is Path.LAYER_IN_TWO_CALLS
        assert _ran_path(monkeypatch, layer, x, megablocks_size=1, capacity_factor=-1.0) is Path.GROUPED_ONE_CALL
        assert _ran_path(monkeypatch, layer, x) is Path.PADDED
    assert _ran_path(monkeypatch, layer, x, megablocks_size=1) is Path.GROUPED
    with torch.no_grad():
        gelu_layer = _llama_layer(activation=F.gelu)
        assert _ran_path(monkeypatch, gelu_layer, x, megablocks_size=1) is Path.GROUPED_PIECES


def test_frozen_experts_with_a_trained_gate_keep_the_gate_gradient(monkeypatch):
    """Grad mode on, the experts frozen, the gate trained: the call is recorded (gradient = yes), so it
    takes the autograd path and the gate's weight gets its gradient."""
    layer = _llama_layer()
    for param in layer.experts.parameters():
        param.requires_grad_(False)
    x = torch.randn(6, 16)
    assert _ran_path(monkeypatch, layer, x, megablocks_size=1) is Path.GROUPED
    layer.gates[0].wg.weight.grad = None
    layer(x, megablocks_size=1).square().sum().backward()
    assert layer.gates[0].wg.weight.grad is not None and layer.gates[0].wg.weight.grad.abs().sum() > 0


def test_routed_experts_calls_take_the_path_the_facts_name(monkeypatch):
    taken = []
    original = routed_module.choose_path

    def spy(entry, facts):
        choice = original(entry, facts)
        taken.append(choice.path)
        return choice

    monkeypatch.setattr(routed_module, "choose_path", spy)
    monkeypatch.setattr(routed_module, "_KEPT_PATHS", {})  # paths kept by earlier calls would skip the spy
    torch.manual_seed(1)
    x, ids = torch.randn(3, 8), torch.randint(0, 4, (3, 2))
    weights, up, down = torch.rand(3, 2), torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    with torch.no_grad():
        routed_experts(x, ids, weights, up, down, gate="swiglu")
        routed_experts(x, ids, weights, up, down, gate="swiglu", post_fn=torch.tanh)
    routed_experts(x.requires_grad_(), ids, weights, up, down, gate="swiglu")
    assert taken == [Path.EXPERTS_ONE_CALL, Path.EXPERTS_PIECES, Path.EXPERTS_GROUPED]


def test_a_call_checks_top_k_once(monkeypatch):
    """forward(top_k=...) is checked where the call's switches are resolved, and by nothing after it
    (the routing API and the operator wrappers check only when called directly)."""
    import tutel.impls.call_settings
    import tutel.impls.fast_dispatch
    import tutel.ops.routing
    checks = []
    for module in (tutel.impls.call_settings, tutel.impls.fast_dispatch, tutel.ops.routing):
        original = module.require_top_k

        def counted(*args, _original=original, _module=module.__name__, **kwargs):
            checks.append(_module)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "require_top_k", counted)
    layer = _llama_layer(k=1)
    layer(torch.randn(4, 16), top_k=2)
    assert checks == ["tutel.impls.call_settings"]
    checks.clear()
    moe.top_k_routing(torch.rand(4, 4), top_k=2)  # the public routing API checks its own arguments
    assert checks == ["tutel.impls.fast_dispatch"]
