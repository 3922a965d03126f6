"""routed_quantized_experts over every format, every gated unit and every activation dtype, at the
token counts of decoding and prefill (0, 1, 3, 17: the decode operator; 64, 300: the grouped
products), with odd widths (block FP8: 200 input features, partial 128 x 128 blocks) and ids
outside [0, E) (expert parallelism's sentinels), against a float64 computation of the experts on
the stacks' reference dequantization (tutel.quant's dequantize_reference, itself held bit-exact to
the specifications in test_quant_formats.py)."""
import pytest
import torch
import torch.nn.functional as F

from tutel.experts import routed_quantized_experts
from tutel.ops.gated_units import GatedUnit
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights

E, K = 7, 4
# (hidden, intermediate) per format: the fp4 formats take whole 32-element blocks; block FP8 any
# width, here partial blocks along both products' inputs
WIDTHS = {"fp8_block": (200, 72), "mxfp4": (96, 64), "nvfp4": (80, 48)}
TOKENS = [0, 1, 3, 17, 64, 300]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# relative to the largest reference value: the activations' rounding between the products, and
# bfloat16 weights where the grouped products round them (tutel.ops.quantized_linear)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
GPT_OSS = GatedUnit(1.702, 1.0, 7.0, interleaved=True)


def swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def gpt_oss(h):
    gate, up = h[..., 0::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
    return (up + 1) * gate * torch.sigmoid(1.702 * gate)


# unit name -> (routed_quantized_experts' keywords, the rule in float64, gated, biases)
UNITS = {"swiglu": (dict(gate="swiglu"), swiglu, True, False),
         "gpt_oss": (dict(gate=GPT_OSS), gpt_oss, True, True),
         "gelu": (dict(activation=F.gelu), F.gelu, False, False),
         "relu": (dict(activation=F.relu), F.relu, False, True)}


def stack(format, rows, columns, seed, interleaved=False):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(E, rows, columns, generator=generator, dtype=torch.float64) * columns ** -0.5
    rows_order = "interleaved" if interleaved else None
    if format == "fp8_block":
        return Fp8BlockWeights.quantize(weight, block=(128, 128), gate_up_rows=rows_order)
    return {"mxfp4": Mxfp4Weights, "nvfp4": Nvfp4Weights}[format].quantize(weight, gate_up_rows=rows_order)


def reference(x, ids, weights, up, down, rule, up_bias, down_bias):
    """sum over each token's kept choices of w * (rule(x Wup^T + bu) Wdown^T + bd), in float64."""
    up_w, down_w = up.dequantize_reference(torch.float64), down.dequantize_reference(torch.float64)
    y = torch.zeros(x.shape[0], down_w.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < E:
                h = rule(up_w[e] @ x[t].double() + up_bias[e])
                y[t] += float(weights[t, j]) * (down_w[e] @ h + down_bias[e])
    return y


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit", sorted(UNITS))
@pytest.mark.parametrize("format", sorted(WIDTHS))
def test_every_format_unit_dtype_and_token_count(format, unit, dtype, tokens):
    keywords, rule, gated, biased = UNITS[unit]
    hidden, inter = WIDTHS[format]
    up = stack(format, 2 * inter if gated else inter, hidden, seed=1, interleaved=unit == "gpt_oss")
    down = stack(format, hidden, inter, seed=2)
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64).to(dtype)
    ids = torch.rand(tokens, E, generator=generator).argsort(dim=1)[:, :K]
    if tokens:  # expert parallelism's sentinels: E and -1 contribute nothing
        ids[0, 0], ids[-1, K - 1] = E, -1
    weights = torch.rand(tokens, K, generator=generator, dtype=torch.float64)
    up_bias = torch.randn(E, up.out_features, generator=generator, dtype=torch.float64) * 0.1 if biased else None
    down_bias = torch.randn(E, hidden, generator=generator, dtype=torch.float64) * 0.1 if biased else None
    with torch.inference_mode():
        y = routed_quantized_experts(x, ids, weights.to(dtype), up, down, up_bias=up_bias, down_bias=down_bias,
                                     **keywords)
    assert y.shape == (tokens, hidden) and y.dtype == dtype
    zeros_up, zeros_down = torch.zeros(E, up.out_features, dtype=torch.float64), torch.zeros(E, hidden,
                                                                                            dtype=torch.float64)
    expected = reference(x, ids, weights.to(dtype), up, down, rule, zeros_up if up_bias is None else up_bias,
                         zeros_down if down_bias is None else down_bias)
    if tokens:
        assert float((y.double() - expected).abs().max()) <= TOLERANCE[dtype] * float(expected.abs().max())
