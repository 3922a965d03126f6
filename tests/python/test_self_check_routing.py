"""route_experts and decode_experts in the first-use self-check and its fallback, on the CPU: the
composite operators that stand in for the CUDA kernels against the float64 references of
test_route_experts.py and test_decode_experts.py (forward, and route_experts' gradient through
autograd); the self-check's routing inputs compare the same in every implementation; deliberately
wrong kernels (objects with the operators as attributes) are caught, and the calls then run the
composite operators."""
import warnings
from types import SimpleNamespace

import pytest
import torch

import reference_route_experts as ref
import test_decode_experts as decode_tests
import test_route_experts as route_tests
from conftest import ALL_DTYPES
from tutel.ops import backend, composite
from tutel.ops import decode_experts as decode_module
from tutel.ops.backend import COMPOSITE, KERNELS, DeviceBackends
from tutel.ops.self_check import (FULL_SIZES, OPERATORS, ROUTING_LEVELS, SOFTMAX_LEVEL_GAP, _BIAS_STEP,
                                  compare_operators)

native = torch.ops.tutel
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _default_environment(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_VARIABLE, raising=False)
    monkeypatch.delenv(backend.SELF_CHECK_VARIABLE, raising=False)


# ------------------------------------------------ the composite operators --
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_the_composite_route_experts_matches_the_float64_reference(dtype):
    """Every option (a spread of their combinations), with the weights' and loss' gradient through
    PyTorch's autograd, which stands in for the operator's backward."""
    generator = torch.Generator().manual_seed(23)
    logits = route_tests.random_logits(37, 16, dtype, generator)
    bias = torch.randn(16, generator=generator) * 0.3
    step = 3 if dtype == torch.float32 else 11
    with backend.use_operators("composite"):
        for o, selection_bias in list(route_tests.option_combinations(3, 4, 2, bias))[::step]:
            route_tests.check_routing(logits, o, selection_bias)


@pytest.mark.parametrize("tokens,experts,k", [(0, 4, 2), (1, 1, 1), (29, 9, 5), (300, 64, 8), (45, 300, 3)])
def test_the_composite_route_experts_on_empty_tiny_odd_and_wide_inputs(tokens, experts, k):
    generator = torch.Generator().manual_seed(tokens + experts)
    logits = route_tests.random_logits(tokens, experts, torch.float32, generator)
    with backend.use_operators("composite"):
        route_tests.check_routing(logits, ref.Options(k, renormalize=True, capacity=2, batch_prioritized=True))
        route_tests.check_routing(logits, ref.Options(k, "sqrt_softplus", capacity=-1, routed_scaling_factor=1.5),
                                  torch.randn(experts, generator=generator, dtype=torch.float64))
        route_tests.check_routing(logits, ref.Options(k, softmax_after_topk=True, capacity=0, with_loss=False))


def test_the_composite_route_experts_follows_the_tie_and_nan_rules():
    logits = torch.tensor([[0.5, 1.0, 1.0, 0.5, 1.0],
                           [0.0, -0.0, 0.0, -1.0, -0.0],
                           [1.0, float("nan"), 2.0, 0.0, 3.0],
                           [0.5, 1.0, 1.0, 0.5, 1.0]])
    for score, after in route_tests.SCORES:
        got = composite.route_experts(logits, 3, score, after, None, 0, 0, False, 1.0, True, 2, False)
        want = native.route_experts(logits, 3, score, after, None, 0, 0, False, 1.0, True, 2, False)
        for number in (0, 2, 3, 4, 5, 6, 7):
            assert torch.equal(got[number], want[number]), (score, after, number)
    got = composite.route_experts(logits, 3, "softmax", False, None, 0, 0, False, 1.0, False, -1, True)
    assert got[0][:, 0].tolist() == [1, 2, 4] and got[0][:, 2].tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "transposed"])
@pytest.mark.parametrize("form", decode_tests.FORMS)
def test_the_composite_decode_experts_matches_the_float64_reference(dtype, transposed, form):
    with backend.use_operators("composite"):
        for sizes in decode_tests.SIZES[::2]:
            p = decode_tests.Problem(dtype, *sizes, transposed, form, seed=sum(sizes) + 1)
            decode_tests.assert_close_scaled(decode_tests.decode_on("cpu", p),
                                             decode_tests.reference(*p.args(), **p.kwargs()), dtype)


# ---------------------------------------------- the self-check's inputs --
def _straddles(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whether a float32 rounding (a few of its ulps) of each float64 score could change the value
    it rounds to in `dtype`."""
    wiggle = 8 * torch.finfo(torch.float32).eps
    return (scores * (1 - wiggle)).to(dtype) != (scores * (1 + wiggle)).to(dtype)


@pytest.mark.parametrize("score", ["sigmoid", "sqrt_softplus"])
def test_the_scored_routing_levels_compare_the_same_whatever_the_last_bit(score):
    """The self-check compares route_experts' choices exactly, so its sigmoid and sqrt(softplus) cases
    use logits whose scores no rounding difference between two implementations can reorder: no score
    near a 16-bit float's rounding boundary; distinct scores, and distinct sums of two (a group's
    score; its experts share the group's bias), far apart; scores below half the bias step."""
    levels = torch.tensor(ROUTING_LEVELS, dtype=torch.float64)
    s = ref.scores(levels, score)
    assert float(s.max()) < _BIAS_STEP / 2
    for dtype in (torch.bfloat16, torch.float16):
        assert not bool(_straddles(s, dtype).any()), dtype
    pairs = torch.triu_indices(len(levels), len(levels))
    sums = s[pairs[0]] + s[pairs[1]]
    for values in (s, sums):
        distinct = torch.unique(values)
        assert len(distinct) == len(values), "two levels (or pairs) give the same score"
        assert float((distinct.diff() / distinct[1:].abs()).min()) > 1e-5


def test_the_softmax_levels_give_exact_top_scores():
    """A token's top softmax score is 1/m for its m best experts to the last bit of float64: the
    others' share of the sum stays below half an ulp of m however many experts there are."""
    most_experts = max(size.experts for size in FULL_SIZES)
    assert most_experts * torch.exp(torch.tensor(-SOFTMAX_LEVEL_GAP, dtype=torch.float64)) < 2.0 ** -54


@pytest.mark.parametrize("operator", ["route_experts", "decode_experts"])
def test_the_cpu_operators_pass_the_full_self_check_against_the_composite_ones(operator):
    assert compare_operators(native, composite, CPU, sizes=FULL_SIZES[:6], operators=[operator]) == {operator: None}


# ----------------------------------------- wrong kernels and the fallback --
def _experts_mirrored(logits, k, score, after, bias, *settings):
    """route_experts of the experts in mirrored order, the ids numbered back: ties go to the higher
    expert, and the per-expert outputs come in mirrored order."""
    mirrored = None if bias is None else bias.flip(0)
    outputs = list(native.route_experts(logits.flip(1), k, score, after, mirrored, *settings))
    outputs[0] = (logits.shape[1] - 1 - outputs[0]).to(torch.int32)
    return tuple(outputs)


def _weights_scaled(*args):
    outputs = list(native.route_experts(*args))
    outputs[1] = outputs[1] * 1.001
    return tuple(outputs)


def _loss_off(*args):
    outputs = list(native.route_experts(*args))
    outputs[8] = outputs[8] * 1.01 + 1e-3
    return tuple(outputs)


def _plan_shifted(*args):
    """grouped_locations one row on for the last expert's choices (a wrong end)."""
    outputs = list(native.route_experts(*args))
    last = outputs[4].shape[0] - 1
    outputs[5] = torch.where(outputs[0] == last, outputs[5] + 1, outputs[5]).to(torch.int32)
    return tuple(outputs)


def _without_routing_weights(x, ids, weights, *rest):
    return native.decode_experts(x, ids, None, *rest)


def _last_feature_dropped(*args):
    out = native.decode_experts(*args).clone()
    out[:, -1] = 0
    return out


def _down_bias_dropped(x, ids, weights, up, down, up_bias, down_bias, *rest):
    return native.decode_experts(x, ids, weights, up, down, up_bias, None, *rest)


WRONG = {
    "route_experts": {"experts mirrored": _experts_mirrored, "weights 0.1% off": _weights_scaled,
                      "loss 1% off": _loss_off, "plan one row on": _plan_shifted},
    "decode_experts": {"routing weights ignored": _without_routing_weights,
                       "last feature dropped": _last_feature_dropped, "down bias dropped": _down_bias_dropped},
}
CASES = [(operator, kind) for operator, kinds in WRONG.items() for kind in kinds]


class Counted:
    """The CPU operators, except `operator`, which is `wrong` and counts its calls."""

    def __init__(self, operator, wrong):
        for name in OPERATORS:
            setattr(self, name, getattr(native, name))
        self.calls = 0

        def counted(*args):
            self.calls += 1
            return wrong(*args)

        setattr(self, operator, counted)


def _choose(kernels):
    chooser = DeviceBackends(kernels, kernels_unavailable=lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = chooser.operators(CPU)
    return chooser, chosen, [w for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("operator,kind", CASES)
def test_a_wrong_kernel_is_caught_and_replaced_by_the_composite_operator(operator, kind):
    kernels = Counted(operator, WRONG[operator][kind])
    chooser, chosen, warned = _choose(kernels)
    assert kernels.calls > 0
    assert len(warned) == 1 and f"kernel of {operator} disagreed" in str(warned[0].message)
    assert getattr(chosen, operator) is getattr(composite, operator)
    choice = chooser.choices()["cpu"][operator]
    assert choice.implementation == COMPOSITE and choice.reason.startswith("self-check failed")
    for other in OPERATORS:
        if other != operator:
            assert chooser.choices()["cpu"][other].implementation == KERNELS


@pytest.mark.parametrize("kind", WRONG["route_experts"])
def test_after_a_wrong_route_experts_the_routing_runs_the_composite_operator(monkeypatch, kind):
    """tutel.ops.route_experts (the layer's planned routing) on the operators the check chose: the
    wrong kernel is not called, and results and gradients are the float64 reference's."""
    kernels = Counted("route_experts", WRONG["route_experts"][kind])
    _, chosen, _ = _choose(kernels)
    monkeypatch.setattr(backend, "_forced", chosen)  # the chosen operators on every device
    kernels.calls = 0
    generator = torch.Generator().manual_seed(4)
    logits = route_tests.random_logits(41, 12, torch.float32, generator)
    route_tests.check_routing(logits, ref.Options(3, renormalize=True, capacity=5, batch_prioritized=True))
    route_tests.check_routing(logits, ref.Options(2, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
                              torch.randn(12, generator=generator))
    assert kernels.calls == 0


@pytest.mark.parametrize("kind", WRONG["decode_experts"])
def test_after_a_wrong_decode_experts_calls_run_the_composite_operator(monkeypatch, kind):
    """tutel.ops.decode_experts on the operators the check chose gives the float64 reference's result
    without calling the wrong kernel, and decode_experts_supported's device test says no, so the
    layer's paths take the grouped path."""
    kernels = Counted("decode_experts", WRONG["decode_experts"][kind])
    _, chosen, _ = _choose(kernels)
    monkeypatch.setattr(backend, "_forced", chosen)
    kernels.calls = 0
    for transposed, form in ((False, "swiglu"), (True, "gpt_oss")):
        p = decode_tests.Problem(torch.bfloat16, 7, 3, 6, 24, 16, 24, transposed, form, seed=5)
        decode_tests.assert_close_scaled(decode_tests.decode_on("cpu", p),
                                         decode_tests.reference(*p.args(), **p.kwargs()), torch.bfloat16)
    assert kernels.calls == 0
    assert not decode_module._kernel_chosen(CPU)
    monkeypatch.setattr(backend, "_forced", native)
    assert decode_module._kernel_chosen(CPU)


def test_the_wrong_kernels_are_used_unchecked_when_the_check_is_off(monkeypatch):
    monkeypatch.setenv(backend.SELF_CHECK_VARIABLE, "0")
    kernels = SimpleNamespace(**{name: getattr(native, name) for name in OPERATORS})
    kernels.route_experts, kernels.decode_experts = _experts_mirrored, _last_feature_dropped
    chooser, chosen, warned = _choose(kernels)
    assert warned == []
    assert chosen.route_experts is _experts_mirrored and chosen.decode_experts is _last_feature_dropped
