"""Routed experts over quantized stacks (tutel.experts.routed_quantized_experts, tutel.ops.quantized_experts)
against a float64 reference written here from the formats' specifications (quant_spec's decoders),
token by token and choice by choice: weight-only, and W8A8 block FP8 with activations quantized by
DeepSeek-V3's rule; block sizes with partial blocks, every scale dtype, the gate forms, empty and odd
token counts, k up to 8, ids outside [0, E); devices (CUDA where there is one) and bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

import quant_spec
from tutel.experts import routed_quantized_experts
from tutel.paths import facts
from tutel.ops.gated_units import SWIGLU, GatedUnit
from tutel.ops.quantized_experts import dequantize_expert, quantized_expert_products, require_device
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights
from tutel.quant.codes import FLOAT8_E8M0FNU

H, I, E = 40, 12, 9  # H and I no multiple of 16 or 32: partial blocks
SCALE_DTYPES = [torch.float32, torch.bfloat16] + ([FLOAT8_E8M0FNU] if FLOAT8_E8M0FNU is not None else [])
# tolerance relative to the largest reference value: each dtype's rounding of the activations
# between the products (float32: the products' float32 accumulation)
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def spec_matrices(stack):
    """The (E, N, K) stack in float64 by quant_spec's element-wise decoder (E8M0 from its bytes)."""
    if isinstance(stack, Fp8BlockWeights):
        if stack.scale_inv.dtype == FLOAT8_E8M0FNU:
            scales = [[[quant_spec.e8m0_value(b) for b in row] for row in matrix]
                      for matrix in stack.scale_inv.view(torch.uint8).tolist()]
        else:
            scales = stack.scale_inv.to(torch.float64).tolist()
        return quant_spec.decode_fp8_block(stack.weight, scales, stack.block)
    if isinstance(stack, Mxfp4Weights):
        return quant_spec.decode_mxfp4(stack.packed, stack.scales)
    return quant_spec.decode_nvfp4(stack.packed, stack.block_scales, stack.global_scales)


def fp8(experts, rows, columns, block, scale_dtype=torch.float32, seed=0, gate_up_rows=None):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(experts, rows, columns, generator=generator, dtype=torch.float64) * 0.3
    return Fp8BlockWeights.quantize(weight, block=block, scale_dtype=scale_dtype, gate_up_rows=gate_up_rows)


def inputs(tokens, k, dtype, seed=1, sentinels=False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=generator, dtype=torch.float64).to(dtype)
    ids = torch.rand(tokens, E, generator=generator).argsort(dim=1)[:, :k]
    if sentinels and tokens:
        # ids outside [0, E): an expert-parallel sentinel, a larger one and a negative one
        ids[0, 0] = E
        ids[-1, k - 1] = E + 3
        ids[tokens // 2, 0] = -1
    weights = torch.rand(tokens, k, generator=generator, dtype=torch.float64).to(dtype)
    return x, ids, weights


def dynamic_reference(values, group):
    """DeepSeek-V3's activation rule in float64: per row and per `group` columns, scale = the float32
    value of amax / 448, codes = E4M3 of value / scale (nearest, ties to even), value = codes * scale."""
    out = values.clone()
    for start in range(0, values.shape[-1], group):
        part = values[..., start:start + group]
        scale = (part.abs().amax(dim=-1, keepdim=True) / 448).to(torch.float32).to(torch.float64)
        codes = (part / scale.clamp(min=1e-12)).to(torch.float8_e4m3fn).to(torch.float64)
        out[..., start:start + group] = codes * scale
    return out


def reference(x, ids, weights, up, down, dtype, *, gate_weight=None, hidden_rule, dynamic=False, up_bias=None,
              down_bias=None):
    """sum over choices of w * down_e(rule(up_e(x))) in float64, one token and choice at a time, where
    up_e(v) = Wup[e] v + up_bias[e] and down_e(v) = Wdown[e] v + down_bias[e] (biases optional).
    With `dynamic`, the activations are rounded to `dtype` where the products hand them on (the
    model's dtype between the products) and each product's input follows dynamic_reference."""
    up_w, down_w = spec_matrices(up), spec_matrices(down)
    if gate_weight is not None:
        up_w = torch.cat((spec_matrices(gate_weight), up_w), dim=1)
    rounded = (lambda v: v.to(dtype).to(torch.float64)) if dynamic else (lambda v: v)
    quantized_up = (lambda v: dynamic_reference(v, up.block[1])) if dynamic else (lambda v: v)
    quantized_down = (lambda v: dynamic_reference(v, down.block[1])) if dynamic else (lambda v: v)
    no_up_bias = torch.zeros(up_w.shape[:2], dtype=torch.float64)
    no_down_bias = torch.zeros(down_w.shape[:2], dtype=torch.float64)
    up_b = no_up_bias if up_bias is None else up_bias.double()
    down_b = no_down_bias if down_bias is None else down_bias.double()
    y = torch.zeros(x.shape[0], down_w.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < up_w.shape[0]:
                continue
            h = rounded(up_w[e] @ quantized_up(x[t].double()) + up_b[e])
            h = rounded(hidden_rule(h))
            y[t] += float(weights[t, j]) * rounded(down_w[e] @ quantized_down(h) + down_b[e])
    return y


@pytest.fixture(params=["decode_line", "products_only"])
def both_paths(request, monkeypatch):
    """Each call as the rules route it (the decode operator up to its line where it computes the
    experts), and with the line at -1: every call on the products path."""
    if request.param == "products_only":
        monkeypatch.setattr(facts, "QUANTIZED_DECODE_MAX_TOKENS", -1)
    return request.param


def swiglu(h):
    gate, up = h.chunk(2)
    return F.silu(gate) * up


def assert_close_to(actual, expected, dtype, tolerance=None):
    """Within `tolerance` (the dtype's by default) of the largest reference value, elementwise."""
    tolerance = TOLERANCE[dtype] if tolerance is None else tolerance
    assert actual.dtype == dtype and actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize("block", [(128, 128), (16, 16), (32, 8)])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_only_equals_the_float64_reference(block, scale_dtype, dtype, both_paths):
    up = fp8(E, 2 * I, H, block, scale_dtype, seed=2, gate_up_rows="concatenated")
    down = fp8(E, H, I, block, scale_dtype, seed=3)
    x, ids, weights = inputs(17, 3, dtype)
    y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")
    assert_close_to(y, reference(x, ids, weights, up, down, dtype, hidden_rule=swiglu), dtype)


@pytest.mark.parametrize("block", [(128, 128), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dynamic_activations_follow_deepseeks_rule(block, dtype):
    up = fp8(E, 2 * I, H, block, seed=4, gate_up_rows="concatenated")
    down = fp8(E, H, I, block, seed=5)
    x, ids, weights = inputs(17, 4, dtype, seed=6)
    y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu", activations="dynamic")
    expected = reference(x, ids, weights, up, down, dtype, hidden_rule=swiglu, dynamic=True)
    # the reference rounds where the products do, so what remains is the output's rounding (and a
    # rare E4M3 code one step apart where float32 and float64 round an activation differently)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 5e-3}[dtype]
    assert_close_to(y, expected, dtype, tolerance)
    # the test tells the modes apart: weight-only is several tolerances away
    weight_only = reference(x, ids, weights, up, down, dtype, hidden_rule=swiglu)
    assert (weight_only - expected).abs().max() > 4 * tolerance * expected.abs().max()


def test_dynamic_activations_of_an_all_zero_group_are_zero():
    up = fp8(E, 2 * I, H, (16, 16), seed=4, gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16), seed=5)
    x, ids, weights = inputs(3, 2, torch.float32)
    x[:, :16] = 0  # the first group of every token
    x[1] = 0       # and a whole token
    y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu", activations="dynamic")
    assert torch.isfinite(y).all() and (y[1] == 0).all()
    assert_close_to(y, reference(x, ids, weights, up, down, torch.float32, hidden_rule=swiglu, dynamic=True),
                    torch.float32)


@pytest.mark.parametrize("tokens", [0, 1, 3, 17])
@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_token_counts_choices_and_ids_outside_the_experts(tokens, k, both_paths):
    up = fp8(E, 2 * I, H, (16, 16), seed=7, gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16), seed=8)
    x, ids, weights = inputs(tokens, k, torch.float32, seed=tokens + k, sentinels=True)
    y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")
    assert y.shape == (tokens, H)
    assert_close_to(y, reference(x, ids, weights, up, down, torch.float32, hidden_rule=swiglu), torch.float32)


def test_no_weights_means_one(both_paths):
    up = fp8(E, 2 * I, H, (16, 16), seed=7, gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16), seed=8)
    x, ids, weights = inputs(5, 2, torch.float32)
    y = routed_quantized_experts(x, ids, None, up, down, gate="swiglu")
    assert_close_to(y, reference(x, ids, torch.ones_like(weights), up, down, torch.float32, hidden_rule=swiglu),
                    torch.float32)


@pytest.mark.parametrize("form", ["gate_fn", "clamped_unit", "up_only", "gate_apart"])
@pytest.mark.parametrize("activations", ["weight_only", "dynamic"])
def test_the_gate_forms(form, activations, both_paths):
    dtype = torch.float32
    x, ids, weights = inputs(11, 3, dtype, seed=9)
    down = fp8(E, H, I, (16, 16), seed=10)
    gate_weight = None
    if form == "up_only":
        up = fp8(E, I, H, (16, 16), seed=11)
        kwargs, rule = dict(activation=F.gelu), F.gelu
    elif form == "gate_apart":  # gate and up quantized apart, the rule seeing [gate | up]
        gate_weight, up = fp8(E, I, H, (16, 16), seed=12), fp8(E, I, H, (16, 16), seed=13)
        kwargs, rule = dict(gate="swiglu", gate_weight=gate_weight), swiglu
    else:
        up = fp8(E, 2 * I, H, (16, 16), seed=14, gate_up_rows="concatenated")
        if form == "gate_fn":
            def rule(h):
                gate, value = h.chunk(2, dim=-1)
                return F.gelu(gate) * value
            kwargs = dict(gate_fn=rule)
        else:
            unit = GatedUnit(alpha=1.702, up_offset=1.0, limit=0.5)

            def rule(h):
                gate, value = h.chunk(2)
                gate, value = gate.clamp(max=0.5), value.clamp(-0.5, 0.5)
                return (value + 1.0) * gate * torch.sigmoid(1.702 * gate)
            kwargs = dict(gate=unit)
    y = routed_quantized_experts(x, ids, weights, up, down, activations=activations, **kwargs)
    expected = reference(x, ids, weights, up, down, dtype, gate_weight=gate_weight, hidden_rule=rule,
                         dynamic=activations == "dynamic")
    assert_close_to(y, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_float16_and_float64_tokens(dtype, both_paths):
    up = fp8(E, 2 * I, H, (32, 32), seed=15, gate_up_rows="concatenated")
    down = fp8(E, H, I, (32, 32), seed=16)
    x, ids, weights = inputs(6, 2, dtype)
    y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")
    assert_close_to(y, reference(x, ids, weights, up, down, dtype, hidden_rule=swiglu), dtype)


def test_many_rows_run_in_pieces(monkeypatch):
    """Rows past a piece's size run piece by piece (experts whose rows straddle two pieces too)."""
    from tutel.paths import experts_pieces
    monkeypatch.setattr(experts_pieces, "piece_rows", lambda row_bytes: 5)
    up = fp8(E, 2 * I, H, (16, 16), seed=17, gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16), seed=18)
    x, ids, weights = inputs(13, 4, torch.bfloat16, sentinels=True)
    y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")
    assert_close_to(y, reference(x, ids, weights, up, down, torch.bfloat16, hidden_rule=swiglu), torch.bfloat16)


@pytest.mark.parametrize("dtype,activations", [(torch.bfloat16, "weight_only"), (torch.float16, "weight_only"),
                                               (torch.float32, "weight_only"), (torch.bfloat16, "dynamic")])
def test_pieces_are_sized_by_the_up_projection_as_the_products_return_it(dtype, activations):
    """The row bytes the pieces are cut by are one row's up projection as the operator's products
    really return it: in the rows' dtype (weight-only), float32 where W8A8 quantizes the rows in
    PyTorch first (a block width of no multiple of 16).  Counting 16-bit rows as float32 cut them
    into twice the pieces they need."""
    from tutel.ops.quantized_experts import _stack_product
    from tutel.paths.work import QuantizedExperts
    up = fp8(E, 2 * I, H, (16, 5), seed=23, gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 5), seed=24)
    rows = torch.randn(3, H, generator=torch.Generator().manual_seed(25), dtype=torch.float64).to(dtype)
    projection = _stack_product(rows, [3] * E, up, None, activations == "dynamic")
    row_bytes = QuantizedExperts(up, down, unit=SWIGLU, activations=activations).grouped_products(dtype)[1]
    assert row_bytes == projection.shape[1] * projection.element_size()


@pytest.mark.parametrize("stack", ["mxfp4", "nvfp4"])
def test_other_formats_run_weight_only(stack, both_paths):
    columns = 64  # a multiple of both formats' scale groups
    generator = torch.Generator().manual_seed(19)
    make = Mxfp4Weights.quantize if stack == "mxfp4" else Nvfp4Weights.quantize
    up = make(torch.randn(4, 2 * 32, columns, generator=generator, dtype=torch.float64), gate_up_rows="concatenated")
    down = make(torch.randn(4, columns, 32, generator=generator, dtype=torch.float64))
    x = torch.randn(5, columns, generator=generator)
    ids = torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0], [1, 4]])
    weights = torch.rand(5, 2, generator=generator)
    y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")
    assert_close_to(y, reference(x, ids, weights, up, down, torch.float32, hidden_rule=swiglu), torch.float32)
    with pytest.raises(ValueError, match="activations='dynamic'.*block-FP8 stacks"):
        routed_quantized_experts(x, ids, weights, up, down, gate="swiglu", activations="dynamic")


def test_one_expert_is_dequantized_at_a_time(monkeypatch):
    """Each product reads one expert's matrix; no call dequantizes a whole stack (the products path:
    float64 tokens, which the decode operator does not take)."""
    from tutel.ops import quantized_experts
    seen = []
    real = quantized_experts.dequantize_expert
    monkeypatch.setattr(quantized_experts, "dequantize_expert",
                        lambda stack, expert, dtype: seen.append(expert) or real(stack, expert, dtype))
    monkeypatch.setattr(Fp8BlockWeights, "dequantize_reference", lambda *a, **k: pytest.fail("whole stack"))
    up = fp8(E, 2 * I, H, (16, 16), seed=20, gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16), seed=21)
    ids = torch.tensor([[4, 1], [4, 7]])
    routed_quantized_experts(torch.randn(2, H, dtype=torch.float64), ids, torch.rand(2, 2), up, down, gate="swiglu")
    assert sorted(seen) == [1, 1, 4, 4, 7, 7]  # the up and the down matrix of each busy expert
    for expert in (0, 8):
        torch.testing.assert_close(real(up, expert, torch.float64), spec_matrices(up)[expert], rtol=0, atol=0)


def test_a_call_autograd_would_record_is_refused():
    up = fp8(E, 2 * I, H, (16, 16), gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16))
    x, ids, weights = inputs(3, 2, torch.float32)
    for tokens, routing in ((x.requires_grad_(), weights), (x.detach(), weights.requires_grad_())):
        with pytest.raises(NotImplementedError, match=r"inference only.*torch\.no_grad\(\)"):
            routed_quantized_experts(tokens, ids, routing, up, down, gate="swiglu")
    with torch.no_grad():
        routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")


def _fake_cuda(shape, dtype=torch.float32):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(shape, dtype=dtype, device="cuda")


def test_tensors_on_another_device_than_the_stacks_are_refused(monkeypatch):
    """CPU stacks with CUDA tokens (and the reverse) raise ValueError naming the tensor and both
    devices; devices other than the CPU and CUDA raise NotImplementedError."""
    with pytest.raises(NotImplementedError, match="`x` is on meta: quantized experts run on the CPU and CUDA"):
        require_device(torch.device("meta"), "`x`")
    require_device(torch.device("cuda", 0), "`x`")
    up = fp8(E, 2 * I, H, (16, 16), gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16))
    x, ids, weights = inputs(3, 2, torch.float32)
    with pytest.raises(ValueError, match=r"`x`: on cuda:0, but the experts' stacks lie on cpu"):
        routed_quantized_experts(_fake_cuda((3, H)), ids, weights, up, down, gate="swiglu")
    monkeypatch.setattr(Fp8BlockWeights, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=r"`x`: on cpu, but the experts' stacks lie on cuda:0"):
        routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")


def test_stacks_on_different_devices_are_refused(monkeypatch):
    up = fp8(E, 2 * I, H, (16, 16), gate_up_rows="concatenated")
    down = Mxfp4Weights.quantize(torch.randn(E, H, 32))
    x, ids, weights = inputs(3, 2, torch.float32)
    monkeypatch.setattr(Fp8BlockWeights, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=r"the stacks lie on different devices \(`up` on cuda:0, `down` on cpu\)"):
        routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")


def test_float64_tokens_on_cuda_are_refused_naming_the_dtype(monkeypatch):
    """float64's products dequantize expert by expert in a loop on the host: CPU only."""
    up = fp8(E, 2 * I, H, (16, 16), gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16))
    monkeypatch.setattr(Fp8BlockWeights, "device", property(lambda self: torch.device("cuda", 0)))
    x = _fake_cuda((3, H), torch.float64)
    ids, weights = _fake_cuda((3, 2), torch.int64), _fake_cuda((3, 2), torch.float64)
    message = r"`x` is torch.float64 on cuda:0: quantized experts on cuda take float32, bfloat16, float16 tokens"
    with pytest.raises(TypeError, match=message), torch.no_grad():
        routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")
    with pytest.raises(TypeError, match=r"rows is torch.float64 on cuda:0.*loop on the host"):
        quantized_expert_products(x, [3] * E, up, down, unit=GatedUnit())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [5, 40])
def test_cuda_computes_what_the_reference_computes(tokens):
    """On a CUDA device (the decode operator up to 32 tokens, the grouped products past it)."""
    up = fp8(E, 2 * I, H, (16, 16), gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16))
    x, ids, weights = inputs(tokens, 2, torch.float32, sentinels=True)
    expected = reference(x, ids, weights, up, down, torch.float32, hidden_rule=swiglu)
    with torch.no_grad():
        got = routed_quantized_experts(x.cuda(), ids.cuda(), weights.cuda(), up.to("cuda"), down.to("cuda"),
                                       gate="swiglu")
    assert got.device.type == "cuda"
    assert_close_to(got.cpu(), expected, torch.float32)


def _bad(**changes):
    up = fp8(E, 2 * I, H, (16, 16), gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16))
    x, ids, weights = inputs(3, 2, torch.float32)
    arguments = dict(x=x, expert_ids=ids, weights=weights, up=up, down=down, gate="swiglu")
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize("changes, error, message", [
    (dict(x=torch.randn(3, H).to(torch.int32)), TypeError, "`x` must be float32"),
    (dict(x=torch.randn(3, 2, H)), ValueError, "`x` must be 2-D"),
    (dict(x=torch.randn(3, H + 1)), ValueError, r"`x` \(3, 41\) must have the 40 features"),
    (dict(expert_ids=torch.zeros(3, 2)), TypeError, "`expert_ids` must hold integers"),
    (dict(expert_ids=torch.zeros(4, 2, dtype=torch.int64)), ValueError, r"`expert_ids` must be \[T, k\]"),
    (dict(weights=torch.rand(3, 3)), ValueError, "`weights` must have the shape of `expert_ids`"),
    (dict(up=torch.randn(E, 2 * I, H)), TypeError, "`up` must be a tutel.quant stack"),
    (dict(down=fp8(E - 1, H, I, (16, 16))), ValueError, "`up` holds 9 experts but `down` 8"),
    (dict(down=fp8(E, H, I + 1, (16, 16))), ValueError, r"`down` \(9, 40, 13\) must take the 12 hidden values"),
    (dict(gate=None, activation=F.gelu), ValueError, r"`down` \(9, 40, 12\) must take the 24 hidden values"),
    (dict(gate=None), ValueError, "give `gate`"),
    (dict(activation=F.gelu), ValueError, "give `gate`"),
    (dict(gate="geglu"), ValueError, "`gate` must be one of"),
    (dict(gate=None, gate_fn=3), TypeError, "`gate_fn` must be callable"),
    (dict(activations="w8a8"), ValueError, r"`activations` must be one of \('weight_only', 'dynamic'\)"),
    (dict(gate_weight=fp8(E, I + 1, H, (16, 16)), up=fp8(E, I, H, (16, 16))), ValueError,
     r"`gate_weight` \(9, 13, 40\) must have the shape of `up` \(9, 12, 40\)"),
    (dict(gate=None, activation=F.gelu, gate_weight=fp8(E, I, H, (16, 16)), up=fp8(E, I, H, (16, 16))), ValueError,
     "`gate_weight` is given but no gate rule"),
    (dict(gate=GatedUnit(interleaved=True), gate_weight=fp8(E, I, H, (16, 16)), up=fp8(E, I, H, (16, 16))),
     ValueError, "an interleaved unit does not apply"),
])
def test_bad_input_names_the_argument(changes, error, message):
    arguments = _bad(**changes)
    with pytest.raises(error, match=message):
        routed_quantized_experts(arguments.pop("x"), arguments.pop("expert_ids"), arguments.pop("weights"),
                                 arguments.pop("up"), arguments.pop("down"), **arguments)


def test_with_tensors_puts_a_checked_stack_over_tensors_of_its_shape():
    stack = fp8(3, 10, 20, (4, 8))
    template = stack.to("meta")
    again = template.with_tensors({"weight": stack.weight.clone(), "scale_inv": stack.scale_inv.clone()})
    assert type(again) is Fp8BlockWeights and again.block == (4, 8) and again.device.type == "cpu"
    torch.testing.assert_close(again.dequantize_reference(), stack.dequantize_reference(), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"tensors\['weight'\]: shape \(3, 10, 21\).*expected shape \(3, 10, 20\)"):
        template.with_tensors({"weight": torch.zeros(3, 10, 21, dtype=torch.float8_e4m3fn),
                               "scale_inv": stack.scale_inv})
    with pytest.raises(ValueError, match=r"tensors\['scale_inv'\]: .*dtype torch.bfloat16"):
        template.with_tensors({"weight": stack.weight, "scale_inv": stack.scale_inv.bfloat16()})
    with pytest.raises(ValueError, match=r"expected a dict of \['scale_inv', 'weight'\]"):
        template.with_tensors({"weight": stack.weight})
    with pytest.raises(ValueError, match="on one device"):
        template.with_tensors({"weight": stack.weight, "scale_inv": stack.scale_inv.to("meta")})


def test_the_dequantized_expert_is_the_specifications():
    for scale_dtype in SCALE_DTYPES:
        stack = fp8(3, 21, 37, (8, 16), scale_dtype, seed=22)  # partial blocks both ways
        spec = spec_matrices(stack)
        for expert in range(3):
            torch.testing.assert_close(dequantize_expert(stack, expert, torch.float64), spec[expert], rtol=0, atol=0)
            assert math.isclose(float((dequantize_expert(stack, expert, torch.float32).double() - spec[expert])
                                      .abs().max()), 0.0, abs_tol=1e-6 * float(spec[expert].abs().max()))


def test_the_call_runs_on_the_experts_entrys_paths(monkeypatch):
    """On the CPU the chooser sends a call past the decode line (or that the decode operator does
    not compute: W8A8) to the kept rows in pieces, a decoding-size call to the decode operator,
    both through tutel.paths.run."""
    from tutel.experts import quantized
    from tutel.rules.paths import Path
    taken = []
    real = quantized.run
    monkeypatch.setattr(quantized, "run", lambda path, work: taken.append(path) or real(path, work))
    up = fp8(E, 2 * I, H, (16, 16), gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16))
    x, ids, weights = inputs(2, 2, torch.float32)
    routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")
    routed_quantized_experts(x, ids, weights, up, down, gate="swiglu", activations="dynamic")
    x, ids, weights = inputs(33, 2, torch.float32)
    routed_quantized_experts(x, ids, weights, up, down, gate="swiglu")
    assert taken == [Path.EXPERTS_QUANTIZED_DECODE, Path.EXPERTS_PIECES, Path.EXPERTS_PIECES]


# -- biases ------------------------------------------------------------------------------------

FP4_H, FP4_I = 64, 32  # the fp4 formats' rows hold whole scale groups (32 for MXFP4, 16 for NVFP4)


def stack_of(format, experts, rows, columns, seed, gate_up_rows=None):
    """A random (E, rows, columns) stack in `format` (fp8_block in (16, 16) blocks)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(experts, rows, columns, generator=generator, dtype=torch.float64) * 0.3
    if format == "fp8_block":
        return Fp8BlockWeights.quantize(weight, block=(16, 16), gate_up_rows=gate_up_rows)
    make = Mxfp4Weights.quantize if format == "mxfp4" else Nvfp4Weights.quantize
    return make(weight, gate_up_rows=gate_up_rows)


def biases(up_rows, outputs, dtype, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return ((torch.randn(E, up_rows, generator=generator, dtype=torch.float64) * scale).to(dtype),
            (torch.randn(E, outputs, generator=generator, dtype=torch.float64) * scale).to(dtype))


def gpt_oss_rule(h):
    """gpt-oss' unit on interleaved [gate, up] pairs: the gate clamped above at 7, the up to [-7, 7],
    (up + 1) * gate * sigmoid(1.702 * gate)."""
    gate, value = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
    return (value + 1.0) * gate * torch.sigmoid(1.702 * gate)


@pytest.mark.parametrize("format", ["fp8_block", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_biases_are_added_to_each_experts_products(format, dtype, bias_dtype, both_paths):
    width, inner = (H, I) if format == "fp8_block" else (FP4_H, FP4_I)
    up = stack_of(format, E, 2 * inner, width, seed=30, gate_up_rows="concatenated")
    down = stack_of(format, E, width, inner, seed=31)
    up_bias, down_bias = biases(2 * inner, width, bias_dtype, seed=32)
    generator = torch.Generator().manual_seed(33)
    x = torch.randn(7, width, generator=generator, dtype=torch.float64).to(dtype)
    ids = torch.rand(7, E, generator=generator).argsort(dim=1)[:, :3]
    ids[0, 0], ids[3, 1] = -1, E  # expert parallelism's sentinels
    weights = torch.rand(7, 3, generator=generator).to(dtype)
    y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu", up_bias=up_bias, down_bias=down_bias)
    expected = reference(x, ids, weights, up, down, dtype, hidden_rule=swiglu, up_bias=up_bias, down_bias=down_bias)
    assert_close_to(y, expected, dtype)
    # the biases matter: without them the result is far off
    assert (reference(x, ids, weights, up, down, dtype, hidden_rule=swiglu) - expected).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_gpt_oss_unit_with_its_biases(dtype, both_paths):
    """The call gpt-oss' front end makes: MXFP4 stacks, the clamped interleaved unit, biases laid out
    like the interleaved rows (large enough that the clamps bite)."""
    up = stack_of("mxfp4", E, 2 * FP4_I, FP4_H, seed=34, gate_up_rows="interleaved")
    down = stack_of("mxfp4", E, FP4_H, FP4_I, seed=35)
    up_bias, down_bias = biases(2 * FP4_I, FP4_H, torch.bfloat16, seed=36, scale=4.0)
    generator = torch.Generator().manual_seed(37)
    x = torch.randn(5, FP4_H, generator=generator, dtype=torch.float64).to(dtype)
    ids = torch.rand(5, E, generator=generator).argsort(dim=1)[:, :4]
    weights = torch.softmax(torch.randn(5, 4, generator=generator), dim=1).to(dtype)
    y = routed_quantized_experts(x, ids, weights, up, down, gate=GatedUnit(1.702, 1.0, 7.0, interleaved=True),
                                 up_bias=up_bias, down_bias=down_bias)
    expected = reference(x, ids, weights, up, down, dtype, hidden_rule=gpt_oss_rule, up_bias=up_bias,
                         down_bias=down_bias)
    assert_close_to(y, expected, dtype)
    spec_up = spec_matrices(up)
    pre_unit = torch.einsum("th,enh->ten", x.double(), spec_up) + up_bias.double()
    assert (pre_unit.abs() > 7).any(), "the test must reach the clamps"


@pytest.mark.parametrize("form", ["gate_apart", "up_only", "gate_fn"])
@pytest.mark.parametrize("activations", ["weight_only", "dynamic"])
def test_biases_with_the_other_gate_forms(form, activations, both_paths):
    """With a gate stack of its own `up_bias` is [E, 2I] for [gate | up]; without a gate [E, I]."""
    dtype = torch.float32
    x, ids, weights = inputs(9, 3, dtype, seed=38, sentinels=True)
    down = fp8(E, H, I, (16, 16), seed=39)
    gate_weight = None
    if form == "gate_apart":
        gate_weight, up = fp8(E, I, H, (16, 16), seed=40), fp8(E, I, H, (16, 16), seed=41)
        kwargs, rule, up_rows = dict(gate="swiglu", gate_weight=gate_weight), swiglu, 2 * I
    elif form == "up_only":
        up = fp8(E, I, H, (16, 16), seed=42)
        kwargs, rule, up_rows = dict(activation=F.relu), F.relu, I
    else:
        up = fp8(E, 2 * I, H, (16, 16), seed=43, gate_up_rows="concatenated")

        def rule(h):
            gate, value = h.chunk(2, dim=-1)
            return torch.tanh(gate) * value
        kwargs, up_rows = dict(gate_fn=rule), 2 * I
    up_bias, down_bias = biases(up_rows, H, torch.float64, seed=44)
    y = routed_quantized_experts(x, ids, weights, up, down, activations=activations, up_bias=up_bias,
                                 down_bias=down_bias, **kwargs)
    expected = reference(x, ids, weights, up, down, dtype, gate_weight=gate_weight, hidden_rule=rule,
                         dynamic=activations == "dynamic", up_bias=up_bias, down_bias=down_bias)
    assert_close_to(y, expected, dtype)


def test_one_bias_alone_and_no_tokens():
    up = fp8(E, 2 * I, H, (16, 16), seed=45, gate_up_rows="concatenated")
    down = fp8(E, H, I, (16, 16), seed=46)
    up_bias, down_bias = biases(2 * I, H, torch.float32, seed=47)
    for tokens in (0, 4, 40):
        x, ids, weights = inputs(tokens, 2, torch.float32, seed=48)
        for kwargs in (dict(up_bias=up_bias), dict(down_bias=down_bias)):
            y = routed_quantized_experts(x, ids, weights, up, down, gate="swiglu", **kwargs)
            assert_close_to(y, reference(x, ids, weights, up, down, torch.float32, hidden_rule=swiglu, **kwargs),
                            torch.float32)


@pytest.mark.parametrize("changes, error, message", [
    (dict(up_bias=torch.zeros(E, 2 * I - 1)), ValueError,
     r"`up_bias` has shape \(9, 23\); expected \[E, U\] = \(9, 24\), laid out as `up`'s rows"),
    (dict(up_bias=torch.zeros(E - 1, 2 * I)), ValueError, r"`up_bias` has shape \(8, 24\); expected .* \(9, 24\)"),
    (dict(up_bias=torch.zeros(2 * I)), ValueError, r"`up_bias` has shape \(24,\); expected"),
    (dict(down_bias=torch.zeros(E, H + 1)), ValueError, r"`down_bias` has shape \(9, 41\); expected \[E, O\] = "
                                                        r"\(9, 40\)"),
    (dict(up_bias=torch.zeros(E, 2 * I, dtype=torch.int32)), TypeError, "`up_bias` must be floating point, got "
                                                                         "torch.int32"),
    (dict(down_bias=[0.0] * H), TypeError, "`down_bias` must be a tensor or None, got list"),
    (dict(gate_weight=fp8(E, I, H, (16, 16)), up=fp8(E, I, H, (16, 16)), up_bias=torch.zeros(E, I)), ValueError,
     r"`up_bias` has shape \(9, 12\); expected \[E, U\] = \(9, 24\), laid out as \[gate \| up\]"),
])
def test_bad_biases_name_the_argument(changes, error, message):
    arguments = _bad(**changes)
    with pytest.raises(error, match=message):
        routed_quantized_experts(arguments.pop("x"), arguments.pop("expert_ids"), arguments.pop("weights"),
                                 arguments.pop("up"), arguments.pop("down"), **arguments)


def test_a_bias_autograd_would_record_is_refused():
    arguments = _bad()
    bias = torch.zeros(E, H, requires_grad=True)
    call = lambda: routed_quantized_experts(arguments["x"], arguments["expert_ids"], arguments["weights"],
                                            arguments["up"], arguments["down"], gate="swiglu", down_bias=bias)
    with pytest.raises(NotImplementedError, match="the biases require grad"):
        call()
    with torch.no_grad():
        assert not call().requires_grad


def test_biases_on_another_device_than_the_stacks_are_refused():
    with pytest.raises(ValueError, match=r"`down_bias`: on cuda:0, but the experts' stacks lie on cpu"):
        arguments = _bad(down_bias=_fake_cuda((E, H)))
        routed_quantized_experts(arguments.pop("x"), arguments.pop("expert_ids"), arguments.pop("weights"),
                                 arguments.pop("up"), arguments.pop("down"), **arguments)
