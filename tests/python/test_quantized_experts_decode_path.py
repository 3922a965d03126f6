"""Routed quantized experts at decoding sizes (tutel.experts.routed_quantized_experts): which path the
rules give a call (tutel.rules.paths on tutel.paths.facts.quantized_experts_facts) and that the
result equals a float64 reference written here from the formula,

    y[t] = sum_j w[t, j] * (Wd[e] unit(Wu[e] x[t] + bu[e]) + bd[e]),   e = ids[t, j] in [0, E),

the matrices taken from the stacks' reference dequantizers: every format x unit x token dtype at
T in {1, 3, 17, 32} with expert parallelism's sentinel ids (-1 and E) on the decode operator, T = 33
and the forms the operator does not compute on the products path."""
import functools

import pytest
import torch
import torch.nn.functional as F

from tutel.experts import quantized as quantized_module
from tutel.experts import routed_quantized_experts
from tutel.ops.gated_units import GatedUnit
from tutel.ops.quantized_experts import decode_form, up_only_unit
from tutel.paths import QuantizedExperts
from tutel.paths.facts import quantized_experts_facts
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights
from tutel.rules.lines import QUANTIZED_DECODE_MAX_TOKENS
from tutel.rules.paths import EXPERTS, Path, choose_path

E, K = 6, 3
H, I = 96, 64           # whole scale groups of both fp4 formats (32 and 16)
FP8_BLOCK = (32, 64)    # partial blocks: 2I = 128 rows / 32, H = 96 columns / 64
FORMATS = ("fp8_block", "mxfp4", "nvfp4")
GPT_OSS = GatedUnit(1.702, 1.0, 7.0, interleaved=True)
# name -> (the call's keyword arguments, gated, the rule in float64 on [.., U] values)
UNITS = {
    "swiglu": (dict(gate="swiglu"), True,
               lambda h: F.silu(h[..., :h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:]),
    "gpt_oss": (dict(gate=GPT_OSS), True,
                lambda h: (h[..., 1::2].clamp(-7.0, 7.0) + 1.0) * h[..., 0::2].clamp(max=7.0)
                * torch.sigmoid(1.702 * h[..., 0::2].clamp(max=7.0))),
    "gelu": (dict(activation=F.gelu), False, lambda h: 0.5 * h * (1.0 + torch.erf(h / 2.0 ** 0.5))),
    "gelu_tanh": (dict(activation=torch.nn.GELU(approximate="tanh")), False,
                  lambda h: 0.5 * h * (1.0 + torch.tanh((2.0 / torch.pi) ** 0.5 * (h + 0.044715 * h ** 3)))),
    "relu": (dict(activation=F.relu), False, lambda h: h.clamp(min=0.0)),
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# relative to the largest reference value: the tokens' and the result's rounding (the operator
# keeps the units' values in float32, the products path in the tokens' dtype)
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _quantize(format, weight, gate_up_rows=None):
    if format == "fp8_block":
        return Fp8BlockWeights.quantize(weight, block=FP8_BLOCK, gate_up_rows=gate_up_rows)
    make = Mxfp4Weights.quantize if format == "mxfp4" else Nvfp4Weights.quantize
    return make(weight, gate_up_rows=gate_up_rows)


@functools.lru_cache(maxsize=None)
def experts_of(format, unit):
    """(up, down, up_bias, down_bias) for `unit`: random stacks and float32 biases, large enough that
    gpt-oss' clamps bite."""
    generator = torch.Generator().manual_seed(FORMATS.index(format) * 10 + list(UNITS).index(unit))
    gated = UNITS[unit][1]
    up_rows = 2 * I if gated else I
    rows = None if not gated else ("interleaved" if unit == "gpt_oss" else "concatenated")
    up = _quantize(format, torch.randn(E, up_rows, H, generator=generator, dtype=torch.float64) * 0.4, rows)
    down = _quantize(format, torch.randn(E, H, I, generator=generator, dtype=torch.float64) * 0.2)
    up_bias = torch.randn(E, up_rows, generator=generator) * 2.0
    down_bias = torch.randn(E, H, generator=generator)
    return up, down, up_bias, down_bias


def routing(tokens, dtype, seed, ids_dtype=torch.int64):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=generator, dtype=torch.float64).to(dtype)
    ids = torch.rand(tokens, E, generator=generator).argsort(dim=1)[:, :K]
    ids[0, 0] = -1                  # expert parallelism's sentinels: another process's choice
    ids[tokens // 2, K - 1] = E     # (both ends of the range)
    weights = torch.rand(tokens, K, generator=generator).to(dtype)
    return x, ids.to(ids_dtype), weights


def reference(x, ids, weights, up, down, rule, up_bias=None, down_bias=None):
    """The formula in float64 (see the module docstring), every choice at once."""
    up_w, down_w = up.dequantize_reference(torch.float64), down.dequantize_reference(torch.float64)
    kept = (ids >= 0) & (ids < E)
    e = ids.long().clamp(0, E - 1)
    h = torch.einsum("tkuh,th->tku", up_w[e], x.double())
    if up_bias is not None:
        h = h + up_bias.double()[e]
    out = torch.einsum("tkoi,tki->tko", down_w[e], rule(h))
    if down_bias is not None:
        out = out + down_bias.double()[e]
    w = torch.ones(ids.shape, dtype=torch.float64) if weights is None else weights.double()
    return (out * (w * kept)[..., None]).sum(dim=1)


def assert_close_to(actual, expected, dtype):
    assert actual.dtype == dtype and actual.shape == expected.shape
    tolerance = TOLERANCE[dtype]
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance * scale)


@pytest.fixture
def paths_run(monkeypatch):
    """The paths routed_quantized_experts hands to tutel.paths.run."""
    taken = []
    real = quantized_module.run
    monkeypatch.setattr(quantized_module, "run", lambda path, work: taken.append(path) or real(path, work))
    return taken


def chosen_path(x, ids, weights, up, down, up_bias=None, down_bias=None, **kwargs):
    """The rules' path for the call, asked as run_quantized asks it."""
    unit = GatedUnit() if kwargs.get("gate") == "swiglu" else kwargs.get("gate")
    experts = QuantizedExperts(up, down, kwargs.get("gate_weight"), unit, kwargs.get("gate_fn"),
                               kwargs.get("activation"), kwargs.get("activations", "weight_only"), up_bias, down_bias)
    return choose_path(EXPERTS, quantized_experts_facts(x, ids, weights, experts)).path


def test_the_line_is_the_operators_range():
    assert QUANTIZED_DECODE_MAX_TOKENS == 32


@pytest.mark.parametrize("tokens", [1, 3, 17, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit", list(UNITS))
@pytest.mark.parametrize("format", FORMATS)
def test_decoding_sizes_take_the_decode_operator_and_equal_the_reference(format, unit, dtype, tokens, paths_run):
    up, down, up_bias, down_bias = experts_of(format, unit)
    kwargs, _, rule = UNITS[unit]
    x, ids, weights = routing(tokens, dtype, seed=tokens)
    assert chosen_path(x, ids, weights, up, down, up_bias, down_bias, **kwargs) == Path.EXPERTS_QUANTIZED_DECODE
    y = routed_quantized_experts(x, ids, weights, up, down, up_bias=up_bias, down_bias=down_bias, **kwargs)
    assert paths_run == [Path.EXPERTS_QUANTIZED_DECODE]
    assert_close_to(y, reference(x, ids, weights, up, down, rule, up_bias, down_bias), dtype)
    if unit == "gpt_oss" and tokens == 32:  # the clamps are reached
        h = torch.einsum("euh,th->teu", up.dequantize_reference(), x.double()) + up_bias.double()
        assert (h[..., 0::2] > 7).any() and (h[..., 1::2].abs() > 7).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("unit", list(UNITS))
@pytest.mark.parametrize("format", FORMATS)
def test_past_the_line_the_products_path_is_equally_right(format, unit, dtype, paths_run):
    up, down, up_bias, down_bias = experts_of(format, unit)
    kwargs, _, rule = UNITS[unit]
    x, ids, weights = routing(QUANTIZED_DECODE_MAX_TOKENS + 1, dtype, seed=33)
    assert chosen_path(x, ids, weights, up, down, up_bias, down_bias, **kwargs) == Path.EXPERTS_PIECES
    y = routed_quantized_experts(x, ids, weights, up, down, up_bias=up_bias, down_bias=down_bias, **kwargs)
    assert paths_run == [Path.EXPERTS_PIECES]
    assert_close_to(y, reference(x, ids, weights, up, down, rule, up_bias, down_bias), dtype)
    # the same tokens one call at a time on the decode operator give the same rows
    first = routed_quantized_experts(x[:32], ids[:32], weights[:32], up, down, up_bias=up_bias, down_bias=down_bias,
                                     **kwargs)
    assert paths_run[-1] == Path.EXPERTS_QUANTIZED_DECODE
    assert_close_to(first, y[:32].double(), dtype)


@pytest.mark.parametrize("format", FORMATS)
def test_no_biases_no_weights_and_narrow_ids(format, paths_run):
    up, down, _, _ = experts_of(format, "swiglu")
    rule = UNITS["swiglu"][2]
    for ids_dtype in (torch.int32, torch.int16, torch.uint8):
        x, ids, _ = routing(5, torch.float32, seed=7, ids_dtype=torch.int64)
        ids = ids.clamp(min=0).to(ids_dtype)  # (uint8 holds no -1)
        y = routed_quantized_experts(x, ids, None, up, down, gate="swiglu")
        assert_close_to(y, reference(x, ids, None, up, down, rule), torch.float32)
    assert paths_run == [Path.EXPERTS_QUANTIZED_DECODE] * 3


def test_no_tokens_and_only_foreign_choices(paths_run):
    up, down, up_bias, down_bias = experts_of("mxfp4", "gpt_oss")
    x = torch.empty(0, H)
    y = routed_quantized_experts(x, torch.empty(0, K, dtype=torch.int64), torch.empty(0, K), up, down, gate=GPT_OSS,
                                 up_bias=up_bias, down_bias=down_bias)
    assert y.shape == (0, H)
    x, _, weights = routing(4, torch.float32, seed=8)
    foreign = torch.tensor([[-1, E, E + 5]] * 4)
    y = routed_quantized_experts(x, foreign, weights, up, down, gate=GPT_OSS, up_bias=up_bias, down_bias=down_bias)
    assert torch.equal(y, torch.zeros(4, H))
    assert paths_run[-1] == Path.EXPERTS_QUANTIZED_DECODE


def _fp8(rows, columns, block, seed, gate_up_rows=None):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(E, rows, columns, generator=generator, dtype=torch.float64) * 0.3
    return Fp8BlockWeights.quantize(weight, block=block, gate_up_rows=gate_up_rows)


def test_fp8_stacks_of_one_scale_per_matrix_share_a_block(paths_run):
    """transformers' FP8 experts without a block: one scale per matrix of each stack, which one
    block covering both gives the operator."""
    up = _fp8(2 * 24, 40, (48, 40), seed=9, gate_up_rows="concatenated")
    down = _fp8(40, 24, (40, 24), seed=10)
    form = decode_form(up, down, None, GatedUnit(), None, None, "weight_only")
    assert form is not None and form.block == (48, 40)
    x, ids, weights = (torch.randn(3, 40), torch.tensor([[0, 5, -1], [2, 2, 6], [1, 3, 4]]), torch.rand(3, 3))
    y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")
    assert paths_run == [Path.EXPERTS_QUANTIZED_DECODE]
    assert_close_to(y, reference(x, ids, weights, up, down, UNITS["swiglu"][2]), torch.float32)


def _unrecognised(h):
    return F.gelu(h)


@pytest.mark.parametrize("case", ["dynamic", "gate_weight", "gate_fn", "unknown_activation", "float64", "mixed_formats",
                                  "fp8_blocks_apart"])
def test_what_the_operator_does_not_compute_takes_the_products_path(case, paths_run):
    dtype, rule = torch.float32, UNITS["swiglu"][2]
    up, down, up_bias, down_bias = experts_of("fp8_block", "swiglu")
    kwargs = dict(gate="swiglu")
    if case == "dynamic":
        kwargs["activations"] = "dynamic"
    elif case == "gate_weight":  # the gates a stack of their own: up_bias is [gate | up]
        generator = torch.Generator().manual_seed(11)
        gate_stack, up = (_quantize("fp8_block", torch.randn(E, I, H, generator=generator, dtype=torch.float64) * 0.4)
                          for _ in range(2))
        kwargs["gate_weight"] = gate_stack
    elif case == "gate_fn":
        kwargs = dict(gate_fn=rule)
    elif case == "unknown_activation":
        up, down, up_bias, down_bias = experts_of("fp8_block", "gelu")
        kwargs, rule = dict(activation=_unrecognised), UNITS["gelu"][2]
    elif case == "float64":
        dtype = torch.float64
    elif case == "mixed_formats":
        up = experts_of("mxfp4", "swiglu")[0]
    else:  # fp8 blocks that no one block gives both stacks
        up = _fp8(2 * I, H, (16, 16), seed=12, gate_up_rows="concatenated")
        down = _fp8(H, I, (32, 32), seed=13)
    x, ids, weights = routing(3, dtype, seed=14)
    assert chosen_path(x, ids, weights, up, down, up_bias, down_bias, **kwargs) == Path.EXPERTS_PIECES
    y = routed_quantized_experts(x, ids, weights, up, down, up_bias=up_bias, down_bias=down_bias, **kwargs)
    assert paths_run == [Path.EXPERTS_PIECES]
    if case == "dynamic":
        return  # (W8A8's reference is test_quantized_experts')
    if case == "gate_weight":
        up = _concatenated(gate_stack, up)
    assert_close_to(y, reference(x, ids, weights, up, down, rule, up_bias, down_bias), dtype)


def _concatenated(gate, up):
    """A stand-in stack whose reference dequantization is [gate; up] rows."""
    class Joined:
        def dequantize_reference(self, dtype=torch.float64):
            return torch.cat((gate.dequantize_reference(dtype), up.dequantize_reference(dtype)), dim=1)
    return Joined()


def test_up_only_units_are_recognised_exactly():
    assert up_only_unit(F.gelu) == "gelu" and up_only_unit(torch.nn.GELU()) == "gelu"
    assert up_only_unit(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert up_only_unit(F.relu) == up_only_unit(torch.relu) == up_only_unit(torch.nn.ReLU()) == "relu"

    class MyGelu(torch.nn.GELU):
        def forward(self, x):
            return super().forward(x) * 2
    for other in (F.silu, torch.nn.SiLU(), MyGelu(), lambda h: F.gelu(h), torch.tanh, None):
        assert up_only_unit(other) is None


def test_the_facts_say_why():
    up, down, up_bias, down_bias = experts_of("nvfp4", "swiglu")
    experts = QuantizedExperts(up, down, None, GatedUnit(), None, None, "weight_only", up_bias, down_bias)
    x, ids, weights = routing(32, torch.bfloat16, seed=15)
    assert quantized_experts_facts(x, ids, weights, experts)["quantized_decode"] is True
    assert quantized_experts_facts(torch.cat((x, x[:1])), torch.cat((ids, ids[:1])), None,
                                   experts)["quantized_decode"] is False
    assert quantized_experts_facts(x.double(), ids, weights, experts)["quantized_decode"] is False
    with torch.enable_grad():
        facts = quantized_experts_facts(x, ids, weights, QuantizedExperts(
            up, down, None, GatedUnit(), up_bias=up_bias.clone().requires_grad_()))
        assert facts["gradient"] is True and facts["quantized_decode"] is True


@pytest.mark.parametrize("block", [(16, 16), (32, 16)])
@pytest.mark.parametrize("activations", ["weight_only", "dynamic"])
def test_transformers_fp8_experts_through_tutel_take_it_too(block, activations, paths_run):
    """transformers' FP8Experts through "tutel" (run_quantized): weight-only at decoding sizes on the
    decode operator, past the line and W8A8 ("dynamic", the checkpoints' scheme) on the products path."""
    finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from tutel.integrations.transformers.fp8_experts import FP8_ACTIVATIONS, tutel_fp8_experts_forward

    class Config:
        hidden_size, intermediate_size, num_local_experts, hidden_act = 64, 48, E, "silu"

    module = finegrained_fp8.FP8Experts(Config(), block_size=block)
    # the flags transformers' use_experts_implementation sets on a model's experts
    module.is_transposed, module.is_concatenated, module.has_post_expert_norm = False, True, False
    module._is_expert_parallel = False
    generator = torch.Generator().manual_seed(16)
    stacks = {}
    with torch.no_grad():  # the module allocates its tensors uninitialised
        for name, rows, columns in (("gate_up_proj", 96, 64), ("down_proj", 64, 48)):
            weight = torch.randn(E, rows, columns, generator=generator, dtype=torch.float64) * 0.3
            stack = Fp8BlockWeights.quantize(weight, block=block)
            getattr(module, name).copy_(stack.weight)
            getattr(module, name + "_scale_inv").copy_(stack.scale_inv)
            stacks[name] = stack
    setattr(module, FP8_ACTIVATIONS, activations)
    for tokens in (5, 33):
        x, ids, weights = (t.to(torch.float32) if t.is_floating_point() else t
                           for t in routing(tokens, torch.float32, seed=tokens))
        x = x[:, :64].contiguous()
        ids = ids.clamp(min=0)  # (transformers' router gives ids in range)
        with torch.no_grad():
            y = tutel_fp8_experts_forward(module, x, ids, weights)
        if activations == "weight_only":
            expected = reference(x, ids, weights, stacks["gate_up_proj"], stacks["down_proj"], UNITS["swiglu"][2])
            assert_close_to(y, expected, torch.float32)
    decode = Path.EXPERTS_QUANTIZED_DECODE if activations == "weight_only" else Path.EXPERTS_PIECES
    assert paths_run == [decode, Path.EXPERTS_PIECES]
