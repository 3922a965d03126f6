"""routed_quantized_experts checks a set of experts (stacks, gate rule, biases) once and keeps what
it found for the next call with the same ones: the kept checks must be used only for the very same
objects (a new stack, a new bias, or a bias whose .data was replaced is checked again), must never
excuse a call's own tensors, and must keep no stack or bias alive."""
import gc
import weakref

import pytest
import torch

import tutel.experts.quantized as quantized_module
from tutel.experts import routed_quantized_experts
from tutel.quant import Mxfp4Weights

H, I, E, K = 64, 64, 6, 2


def stacks(seed=0, inner=I):
    generator = torch.Generator().manual_seed(seed)
    up = Mxfp4Weights.quantize(torch.randn(E, 2 * inner, H, generator=generator, dtype=torch.float64))
    down = Mxfp4Weights.quantize(torch.randn(E, H, inner, generator=generator, dtype=torch.float64))
    return up, down


def tokens(count=3, width=H, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, width, generator=generator)
    ids = torch.rand(count, E, generator=generator).argsort(dim=1)[:, :K]
    weights = torch.rand(count, K, generator=generator)
    return x, ids, weights


@pytest.fixture
def checks_counted(monkeypatch):
    """How many times the experts' own checks ran."""
    counted = {"runs": 0}
    real = quantized_module.check_quantized_experts

    def counting(*args, **kwargs):
        counted["runs"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(quantized_module, "check_quantized_experts", counting)
    return counted


def call(x, ids, weights, up, down, **kwargs):
    with torch.no_grad():
        return routed_quantized_experts(x, ids, weights, up, down, gate="swiglu", **kwargs)


def test_the_same_experts_are_checked_once_and_give_the_same_result(checks_counted):
    up, down = stacks()
    bias = torch.randn(E, H)
    x, ids, weights = tokens()
    first = call(x, ids, weights, up, down, down_bias=bias)
    second = call(x, ids, weights, up, down, down_bias=bias)
    assert checks_counted["runs"] == 1
    assert torch.equal(first, second)
    # other parts: checked again
    call(x, ids, weights, up, down)
    call(x, ids, weights, up, down, down_bias=torch.randn(E, H))
    call(x, ids, weights, up, stacks(seed=2)[1], down_bias=bias)
    assert checks_counted["runs"] == 4


def test_a_call_with_a_gate_callable_is_checked_every_time(checks_counted):
    up, down = stacks()
    x, ids, weights = tokens()

    def gate_fn(h):
        gate, value = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * value

    with torch.no_grad():
        for _ in range(2):
            routed_quantized_experts(x, ids, weights, up, down, gate_fn=gate_fn)
    assert checks_counted["runs"] == 2


def test_kept_checks_do_not_excuse_a_calls_own_tensors():
    up, down = stacks()
    x, ids, weights = tokens()
    call(x, ids, weights, up, down)
    wide, _, _ = tokens(width=H + 32)
    with pytest.raises(ValueError, match="`x`"):
        call(wide, ids, weights, up, down)
    with pytest.raises((ValueError, TypeError), match="weights"):
        call(x, ids, weights[:, :1], up, down)
    with pytest.raises(TypeError, match="`x`"):
        call(x.to(torch.int32), ids, weights, up, down)


def test_a_new_down_stack_or_bias_that_does_not_fit_is_refused():
    up, down = stacks()
    x, ids, weights = tokens()
    bias = torch.randn(E, H)
    call(x, ids, weights, up, down, down_bias=bias)
    narrow_down = stacks(seed=3, inner=I // 2)[1]
    with pytest.raises(ValueError, match="`down`"):
        call(x, ids, weights, up, narrow_down, down_bias=bias)
    with pytest.raises(ValueError, match="down_bias"):
        call(x, ids, weights, up, down, down_bias=torch.randn(E, H + 1))


def test_a_bias_whose_data_was_replaced_is_checked_again(checks_counted):
    up, down = stacks()
    x, ids, weights = tokens()
    bias = torch.nn.Parameter(torch.randn(E, H), requires_grad=False)
    call(x, ids, weights, up, down, down_bias=bias)
    bias.data = torch.randn(E, H, dtype=torch.float64)  # the same object, another dtype: fits
    call(x, ids, weights, up, down, down_bias=bias)
    assert checks_counted["runs"] == 2
    bias.data = torch.randn(E + 1, H)  # another shape
    with pytest.raises(ValueError, match="down_bias"):
        call(x, ids, weights, up, down, down_bias=bias)


def test_an_id_reused_by_another_stack_is_checked_again(checks_counted):
    up, down = stacks()
    x, ids, weights = tokens()
    call(x, ids, weights, up, down)
    narrow_down = stacks(seed=3, inner=I // 2)[1]
    # what a new stack born at the dead one's address would find: the entry under its id
    kept = quantized_module._CHECKED[up]
    (key, entry), = kept.items()
    kept[(id(narrow_down),) + key[1:]] = entry
    with pytest.raises(ValueError, match="`down`"):
        call(x, ids, weights, up, narrow_down)
    assert checks_counted["runs"] == 2


def test_kept_checks_keep_nothing_alive():
    up, down = stacks()
    bias = torch.randn(E, H)
    x, ids, weights = tokens()
    call(x, ids, weights, up, down, down_bias=bias)
    refs = [weakref.ref(down), weakref.ref(bias)]
    del down, bias  # the up stack lives on (a layer whose down projection was replaced, say)
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    up_ref = weakref.ref(up)
    del up
    gc.collect()
    assert up_ref() is None
