"""Kept call plans (tutel.impls.call_plans, tutel.paths.settled): an inference call like an earlier
one takes the earlier call's checks, switches, dtype and path, and any change those depend on makes
a new plan, so a layer computes what a fresh layer of the same state computes."""
import copy
import pickle

import pytest
import torch

import tutel.impls.call_plans as call_plans
from test_grouped_experts import make_layer
from tutel.experts import routed
from tutel.rules import paths as path_rules
from tutel.rules.lines import MIN_PIECE_ROWS
from tutel.rules.paths import Path, PathChoice


def _plans(layer):
    return layer.__dict__.get(call_plans._PLANS) or {}


def _fresh_output(layer, x, **switches):
    """What a copy of `layer` with no kept plan computes (the reference: every decision made anew)."""
    fresh = copy.deepcopy(layer)
    assert not _plans(fresh)
    with torch.no_grad():
        return fresh(x, **switches)


def _count_decisions(monkeypatch):
    made = []
    original = call_plans._decide

    def counting(*args):
        made.append(True)
        return original(*args)
    monkeypatch.setattr(call_plans, "_decide", counting)
    return made


def test_an_inference_call_like_an_earlier_one_takes_its_plan(monkeypatch):
    torch.manual_seed(1)
    layer = make_layer(6, 2, 1.0).eval()
    made = _count_decisions(monkeypatch)
    x = torch.randn(9, 10, dtype=torch.float64)
    with torch.no_grad():
        first = layer(x)
        second = layer(x)
        layer(torch.randn(5, 10, dtype=torch.float64))  # another shape: another plan
    assert len(made) == 2 and len(_plans(layer)) == 2
    assert torch.equal(first, second)


def test_training_calls_keep_no_plan(monkeypatch):
    layer = make_layer(4, 2, 1.0)
    made = _count_decisions(monkeypatch)
    x = torch.randn(7, 10, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()
    layer(x)
    assert len(made) == 2 and not _plans(layer)


@pytest.mark.parametrize("change", ["gate capacity", "gate k", "training", "postscore", "experts replaced",
                                    "dtype", "backend variable", "rules replaced"])
def test_a_changed_setting_makes_a_new_plan(monkeypatch, change):
    """After each change the layer computes what a fresh copy computes (with its capacity,
    k, mode, dtype...), and the change made a plan of its own."""
    torch.manual_seed(2)
    layer = make_layer(5, 2, 1.0, model_dim=10).eval()
    x = torch.randn(23, 10, dtype=torch.float64)
    with torch.no_grad():
        before = layer(x)
    made = _count_decisions(monkeypatch)
    if change == "gate capacity":  # 0.25 drops choices the first call kept
        layer.gates[0].capacity_factor = 0.25
    elif change == "gate k":
        layer.gates[0].top_k = 1
    elif change == "training":
        layer.train()
    elif change == "postscore":
        layer.is_postscore = False
    elif change == "experts replaced":
        other = make_layer(5, 2, 1.0, model_dim=10)
        layer.experts = other.experts
    elif change == "dtype":
        layer.to(torch.float32)
        x = x.float()
    elif change == "backend variable":
        monkeypatch.setenv("TUTEL_CUDA_BACKEND", "composite")
    elif change == "rules replaced":
        monkeypatch.setattr(path_rules, "RULES", tuple(list(path_rules.RULES)))  # a new tuple
    with torch.no_grad():
        after = layer(x)
    assert made == [True]
    assert torch.equal(after, _fresh_output(layer, x))
    if change in ("gate capacity", "gate k", "postscore", "experts replaced"):
        assert not torch.allclose(after, before.to(after.dtype))


def test_moving_or_loading_the_layer_drops_its_plans():
    layer = make_layer(3, 1, 1.0).eval()
    with torch.no_grad():
        layer(torch.randn(4, 10, dtype=torch.float64))
    assert _plans(layer)
    layer.to(torch.float64)
    assert not _plans(layer)
    with torch.no_grad():
        layer(torch.randn(4, 10, dtype=torch.float64))
    layer.load_state_dict(layer.state_dict())
    assert not _plans(layer)


def test_copies_and_pickles_start_without_plans():
    layer = make_layer(3, 2, 1.0).eval()
    with torch.no_grad():
        layer(torch.randn(4, 10, dtype=torch.float64))
    assert _plans(layer)
    assert not _plans(copy.deepcopy(layer))
    assert not _plans(pickle.loads(pickle.dumps(layer)))


def test_bad_switches_raise_as_before_with_plans_kept():
    layer = make_layer(3, 2, 1.0).eval()
    x = torch.randn(4, 10, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
        with pytest.raises(TypeError):
            layer(x, top_k=[1])  # unhashable: no plan is looked up, the check names it
        with pytest.raises(ValueError, match="top_k"):
            layer(x, top_k=9)
        with pytest.raises(ValueError, match="gate_index"):
            layer(x, gate_index=4)
        with pytest.raises(ValueError, match="model_dim"):
            layer(torch.randn(4, 9, dtype=torch.float64))


def test_a_forced_path_applies_to_new_plans(monkeypatch):
    """Tests and tools force a path through choose_layer_path; a plan made after that takes it."""
    layer = make_layer(3, 2, 1.0).eval()
    monkeypatch.setattr(call_plans, "choose_layer_path", lambda *args: PathChoice(Path.PADDED, "forced"))
    with torch.no_grad():
        layer(torch.randn(4, 10, dtype=torch.float64))
    assert [plan.choice.path for plan in _plans(layer).values()] == [Path.PADDED]


def test_routed_experts_keep_the_path_of_their_facts(monkeypatch):
    """routed_experts' inference calls keep the path by what their facts read: a call of another
    token count or k chooses again, and the kept answer is the chooser's."""
    monkeypatch.setattr(routed, "_KEPT_PATHS", {})
    chosen = []
    original = routed.choose_path

    def counting(entry, facts):
        chosen.append(facts["rows_fit_one_call"])
        return original(entry, facts)
    monkeypatch.setattr(routed, "choose_path", counting)
    torch.manual_seed(3)
    up, down = torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    many = MIN_PIECE_ROWS // 2 + 1  # x 2 choices: past one call's rows
    with torch.no_grad():
        for tokens, k in ((3, 2), (3, 2), (many, 2), (3, 1), (many, 2)):
            x = torch.randn(tokens, 8)
            ids = torch.randint(0, 4, (tokens, k))
            weights = torch.rand(tokens, k)
            out = routed.routed_experts(x, ids, weights, up, down, gate="swiglu")
            # float64 reference: every choice's SwiGLU expert, weighted, summed per token
            h = torch.einsum("th,tkuh->tku", x.double(), up.double()[ids])
            g, u = h.chunk(2, dim=-1)
            y = torch.einsum("tki,tkoi->tko", torch.nn.functional.silu(g) * u, down.double()[ids])
            reference = (weights.double().unsqueeze(-1) * y).sum(1)
            torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-4)
    assert chosen == [True, False, True]
