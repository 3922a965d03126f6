"""DeepSpeed's MoE layer computes the same with use_tutel=True (backed by this
package) as with use_tutel=False: outputs, l_aux, expert counts and every gradient.

Run by run.sh once per pinned DeepSpeed release.  Both layers get the same
weights, inputs and random seed (random token selection, the top-2 Gumbel
sample and noisy gates draw the same numbers), so any difference comes from the
dispatch and combine computed by tutel.
"""
import os
from typing import Dict, NamedTuple, Optional

import pytest
import torch

import deepspeed
from deepspeed.moe import sharded_moe
from deepspeed.moe.layer import MoE

import tutel
from tutel import moe as tutel_moe

MODEL_DIM, HIDDEN_DIM = 7, 11
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


class Case(NamedTuple):
    k: int
    capacity_factor: float
    drop_tokens: bool
    use_rts: bool = True
    second_expert_sampling: bool = True
    num_experts: int = 5
    min_capacity: int = 0

    def __str__(self) -> str:
        text = f"k{self.k}-E{self.num_experts}-" + (f"cf{self.capacity_factor}" if self.drop_tokens else "dropless")
        if self.k == 1:
            text += "-rts" if self.use_rts else "-no_rts"
        if self.k == 2 and not self.second_expert_sampling:
            text += "-argmax2nd"
        return text


def routing_cases():
    cases = []
    for use_rts in (True, False):
        cases += [Case(1, factor, True, use_rts=use_rts) for factor in (0.5, 1.0, 2.0)]
        cases.append(Case(1, 1.0, False, use_rts=use_rts))
    for sampling in (True, False):
        cases += [Case(2, factor, True, second_expert_sampling=sampling) for factor in (0.5, 2.0)]
        cases.append(Case(2, 1.0, False, second_expert_sampling=sampling))
    cases += [Case(3, factor, True) for factor in (0.5, 1.0)] + [Case(3, 1.0, False)]
    cases += [Case(1, 0.5, True, num_experts=1), Case(1, 0.75, True, num_experts=16),
              Case(2, 0.5, True, num_experts=16), Case(1, 0.1, True, min_capacity=4)]
    return cases


def build_pair(case: Case, dtype: torch.dtype, **options):
    """(use_tutel=False layer, use_tutel=True layer) with identical weights."""
    torch.manual_seed(20240 + case.k)
    expert = torch.nn.Sequential(torch.nn.Linear(MODEL_DIM, HIDDEN_DIM), torch.nn.GELU(),
                                 torch.nn.Linear(HIDDEN_DIM, MODEL_DIM))
    arguments = dict(num_experts=case.num_experts, k=case.k, capacity_factor=case.capacity_factor,
                     eval_capacity_factor=case.capacity_factor, min_capacity=case.min_capacity,
                     drop_tokens=case.drop_tokens, use_rts=case.use_rts,
                     top2_2nd_expert_sampling=case.second_expert_sampling, **options)
    native = MoE(MODEL_DIM, expert, use_tutel=False, **arguments).to(dtype)
    accelerated = MoE(MODEL_DIM, expert, use_tutel=True, **arguments).to(dtype)
    accelerated.load_state_dict(native.state_dict())
    assert native.deepspeed_moe.use_tutel is False
    return native, accelerated


# DeepSpeed 0.19 routes top-1, top-2 and top-k gates through tutel; earlier releases only top-1.
EVERY_K_THROUGH_TUTEL_SINCE = (0, 19)


def release_routes_through_tutel(k: int) -> bool:
    """Whether the installed DeepSpeed release sends a top-`k` gate through tutel (by its version)."""
    release = tuple(int(part) for part in deepspeed.__version__.split(".")[:2])
    return k == 1 or release >= EVERY_K_THROUGH_TUTEL_SINCE


def require_tutel_path(layer: MoE, k: int) -> None:
    """Fails if the layer does not take the path its DeepSpeed release promises for `k`; skips
    (naming the release) where that release routes `k` around tutel."""
    expected = release_routes_through_tutel(k)
    assert layer.deepspeed_moe.use_tutel is expected, (
        f"DeepSpeed {deepspeed.__version__} should {'' if expected else 'not '}route a top-{k} gate through tutel "
        f"with use_tutel=True, but MOELayer.use_tutel is {layer.deepspeed_moe.use_tutel}")
    if not expected:
        pytest.skip(f"DeepSpeed {deepspeed.__version__} routes only top-1 gates through tutel (k={k})")


class CallCounter:
    """Counts calls to tutel.moe.fast_cumsum_sub_one made from DeepSpeed."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = tutel_moe.fast_cumsum_sub_one

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(tutel_moe, "fast_cumsum_sub_one", counted)


def forward_backward(layer: MoE, x: torch.Tensor, upstream: torch.Tensor, seed: int,
                     used_token: Optional[torch.Tensor] = None, train: bool = True) -> Dict[str, torch.Tensor]:
    layer.train(train)
    x = x.detach().clone().requires_grad_(train)
    torch.manual_seed(seed)  # the same random draws for both layers
    with torch.set_grad_enabled(train):
        output, l_aux, exp_counts = layer(x) if used_token is None else layer(x, used_token)
    results = {"output": output, "l_aux": l_aux.reshape(1), "exp_counts": exp_counts}
    if train:
        ((output * upstream).sum() + 0.37 * l_aux).backward()
        results["input gradient"] = x.grad
        for name, parameter in layer.named_parameters():
            assert parameter.grad is not None, f"no gradient for {name}"
            results[f"gradient of {name}"] = parameter.grad
    return results


def assert_same(tutel_results, native_results, dtype, record_difference):
    assert tutel_results.keys() == native_results.keys()
    for name, expected in native_results.items():
        actual = tutel_results[name]
        if name == "exp_counts":
            assert torch.equal(actual, expected)
            continue
        assert actual.dtype == expected.dtype, name
        record_difference(dtype, actual, expected)
        torch.testing.assert_close(actual, expected, **TOLERANCE[dtype], msg=lambda m: f"{name}: {m}")


def dropped_choices(layer: MoE) -> int:
    """Choices the tutel dispatcher did not dispatch in the last forward (negative index or past capacity)."""
    dispatcher = layer.deepspeed_moe._tutel_dispatcher
    assert isinstance(dispatcher, tutel_moe.TutelMoeFastDispatcher)
    # Tutel's public dispatcher attributes: [k, T] int32 tables and the capacity.
    return int(((dispatcher.indices_ < 0) | (dispatcher.locations_ >= dispatcher.capacity)).sum())


def test_deepspeed_uses_this_package():
    assert sharded_moe.TUTEL_INSTALLED, "deepspeed.moe.sharded_moe could not import tutel"
    assert sharded_moe.tutel_moe is tutel_moe
    assert os.path.dirname(os.path.abspath(tutel.__file__)) == os.path.join(REPO_ROOT, "tutel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", routing_cases(), ids=str)
def test_tutel_path_equals_native(case, dtype, deepspeed_world, record_difference, monkeypatch):
    native, accelerated = build_pair(case, dtype)
    require_tutel_path(accelerated, case.k)
    counter = CallCounter(monkeypatch)
    x = torch.randn(3, 13, MODEL_DIM, dtype=dtype)
    upstream = torch.randn(3, 13, MODEL_DIM, dtype=dtype)

    tutel_results = forward_backward(accelerated, x, upstream, seed=11)
    assert counter.calls == (1 if case.k == 1 else 0)
    dropped = dropped_choices(accelerated)
    native_results = forward_backward(native, x, upstream, seed=11)
    assert_same(tutel_results, native_results, dtype, record_difference)

    if not case.drop_tokens:
        assert dropped == 0
    elif case.capacity_factor <= 0.5 and case.num_experts > 1:
        assert dropped > 0, "the case meant to drop tokens dropped none"


@pytest.mark.parametrize("policy", ["RSample", "Jitter"])
def test_noisy_gates(policy, deepspeed_world, record_difference):
    case = Case(1, 0.75, True)
    native, accelerated = build_pair(case, torch.float64, noisy_gate_policy=policy)
    x, upstream = torch.randn(40, MODEL_DIM, dtype=torch.float64), torch.randn(40, MODEL_DIM, dtype=torch.float64)
    assert_same(forward_backward(accelerated, x, upstream, seed=3),
                forward_backward(native, x, upstream, seed=3), torch.float64, record_difference)


def test_used_token_mask(deepspeed_world, record_difference):
    native, accelerated = build_pair(Case(1, 1.0, True), torch.float32)
    x, upstream = torch.randn(30, MODEL_DIM), torch.randn(30, MODEL_DIM)
    used = (torch.rand(30) > 0.3).long()
    tutel_results = forward_backward(accelerated, x, upstream, seed=5, used_token=used)
    native_results = forward_backward(native, x, upstream, seed=5, used_token=used)
    assert_same(tutel_results, native_results, torch.float32, record_difference)
    assert torch.all(tutel_results["output"][used == 0] == 0)


@pytest.mark.parametrize("k", [1, 2])
def test_eval_mode(k, deepspeed_world, record_difference):
    native, accelerated = build_pair(Case(k, 0.5, True), torch.float64)
    require_tutel_path(accelerated, k)
    x = torch.randn(2, 17, MODEL_DIM, dtype=torch.float64)
    assert_same(forward_backward(accelerated, x, None, seed=8, train=False),
                forward_backward(native, x, None, seed=8, train=False), torch.float64, record_difference)


@pytest.mark.parametrize("k", [1, 2])
def test_one_dispatcher_serves_batches_of_any_size(k, deepspeed_world, record_difference):
    """DeepSpeed builds the dispatcher once and calls update() with each batch's capacity."""
    native, accelerated = build_pair(Case(k, 1.0, False), torch.float32)
    require_tutel_path(accelerated, k)
    dispatchers = set()
    for step, tokens in enumerate((29, 4, 64, 1)):
        x, upstream = torch.randn(tokens, MODEL_DIM), torch.randn(tokens, MODEL_DIM)
        for layer in (native, accelerated):
            layer.zero_grad()
        tutel_results = forward_backward(accelerated, x, upstream, seed=step)
        dispatchers.add(id(accelerated.deepspeed_moe._tutel_dispatcher))
        assert_same(tutel_results, forward_backward(native, x, upstream, seed=step), torch.float32,
                    record_difference)
    assert len(dispatchers) == 1
