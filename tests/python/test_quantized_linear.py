"""tutel.ops.quantized_linear.quantized_grouped_linear (the operator tutel::quantized_grouped_linear)
on the CPU: rows grouped by expert times MXFP4 / NVFP4 / block-FP8 stacks, against a float64
reference written from the formula, y[r] = rows[r] @ W[e]^T + bias[e], with W each stack's float64
reference dequantization (tested against the formats' specifications in test_quant_formats.py)."""
import pytest
import torch

from tutel.ops.quantized_linear import (quantized_grouped_linear, quantized_linear_kernel_sets,
                                        quantized_linear_kernels, set_quantized_linear_kernels,
                                        using_quantized_linear_kernels)
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights
from tutel.quant.activations import dynamic_activations

FORMATS = ("mxfp4", "nvfp4", "fp8_block")
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_SETS = quantized_linear_kernel_sets()


def make_stack(format, experts, outputs, features, seed, block=(128, 128), scale_dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(experts, outputs, features, generator=generator, dtype=torch.float64)
    weight *= torch.rand(experts, outputs, 1, generator=generator, dtype=torch.float64) * 4 + 0.05
    if format == "mxfp4":
        return Mxfp4Weights.quantize(weight)
    if format == "nvfp4":
        return Nvfp4Weights.quantize(weight)
    return Fp8BlockWeights.quantize(weight, block=block, scale_dtype=scale_dtype)


def make_ends(rows, experts, seed, past_last_end=True):
    """Random ends with empty experts among them, and (when asked) rows past the last end."""
    generator = torch.Generator().manual_seed(seed)
    grouped = rows - int(torch.randint(0, rows // 4 + 1, (1,), generator=generator)) if past_last_end else rows
    weights = torch.rand(experts, generator=generator)
    weights[torch.rand(experts, generator=generator) < 0.3] = 0  # empty experts
    if weights.sum() == 0:
        weights[-1] = 1
    counts = torch.floor(weights / weights.sum() * grouped).long()
    counts[int(torch.argmax(weights))] += grouped - int(counts.sum())
    return torch.cumsum(counts, 0)


def reference(rows, ends, stack, bias):
    """float64: each expert's rows times its float64-dequantized matrix plus bias; other rows zero;
    and sum |x| |W| + |bias| per output, the scale of each output's rounding error."""
    weights = stack.dequantize_reference(torch.float64)
    x = rows.double()
    out = torch.zeros(rows.shape[0], stack.out_features, dtype=torch.float64)
    magnitude = torch.zeros_like(out)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end] @ weights[expert].t()
        magnitude[start:end] = x[start:end].abs() @ weights[expert].abs().t()
        if bias is not None:
            out[start:end] += bias[expert].double()
            magnitude[start:end] += bias[expert].double().abs()
        start = end
    return out, magnitude


# Per rows' dtype: (error relative to sum |x| |W|: the weights' and the float32 sums' rounding,
# error relative to |y|: the output's rounding).  bfloat16 rows may take bfloat16 weights (AMX).
TOLERANCES = {torch.float32: (2e-6, 1e-6), torch.float16: (2e-6, 2 ** -11), torch.bfloat16: (2 ** -8, 2 ** -8)}


def check_close(got, rows, ends, stack, bias):
    assert got.dtype == rows.dtype and tuple(got.shape) == (rows.shape[0], stack.out_features)
    expected, magnitude = reference(rows, ends, stack, bias)
    to_sum, to_out = TOLERANCES[rows.dtype]
    error = (got.double() - expected).abs()
    bound = to_sum * magnitude + to_out * expected.abs() + 1e-30
    worst = (error / bound).max().item() if error.numel() else 0.0
    assert worst <= 1.0, f"error {error.max().item():.3g} exceeds the bound by {worst:.3g}x"
    last = int(ends[-1])
    assert torch.count_nonzero(got[last:]) == 0  # the rows of no expert


def features_of(format):
    return 200 if format == "fp8_block" else 64


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
@pytest.mark.parametrize("experts", (1, 3, 8))
@pytest.mark.parametrize("rows", (0, 1, 3, 17, 64, 300))
def test_every_format_dtype_and_size(format, dtype, experts, rows):
    features = features_of(format)
    stack = make_stack(format, experts, 97, features, seed=rows * 31 + experts)
    generator = torch.Generator().manual_seed(rows + 7)
    x = torch.randn(rows, features, generator=generator).to(dtype)
    ends = make_ends(rows, experts, seed=rows + experts)
    bias = torch.randn(experts, 97, generator=generator) if rows % 2 else None
    with torch.no_grad():
        got = quantized_grouped_linear(x, ends, stack, bias)
    check_close(got, x, ends, stack, bias)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
def test_every_kernel_set(kernels, format, dtype):
    features = features_of(format)
    stack = make_stack(format, 3, 97, features, seed=5)
    x = torch.randn(70, features, generator=torch.Generator().manual_seed(3)).to(dtype)
    ends = make_ends(70, 3, seed=11)
    bias = torch.randn(3, 97, dtype=torch.bfloat16)
    with using_quantized_linear_kernels(kernels), torch.no_grad():
        assert quantized_linear_kernels() == kernels
        got = quantized_grouped_linear(x, ends, stack, bias)
    check_close(got, x, ends, stack, bias)
    assert quantized_linear_kernels() == KERNEL_SETS[0]


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("block, scale_dtype", [((3, 48), torch.float32), ((128, 128), torch.bfloat16),
                                                ((1, 16), torch.float32), ((64, 200), torch.bfloat16),
                                                ((5, 64), torch.float32)])
def test_fp8_blocks_of_every_shape(kernels, block, scale_dtype):
    # 48- and 16-wide blocks cross the kernels' 32-value steps; 200 is the whole row; 64-wide blocks
    # of 5 rows span two steps each with scales that differ within 16 rows.
    stack = make_stack("fp8_block", 2, 37, 200, seed=9, block=block, scale_dtype=scale_dtype)
    x = torch.randn(40, 200, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ends = torch.tensor([15, 40])
    with using_quantized_linear_kernels(kernels), torch.no_grad():
        check_close(quantized_grouped_linear(x, ends, stack), x, ends, stack, None)
        check_close(quantized_grouped_linear(x.float(), ends, stack), x.float(), ends, stack, None)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="PyTorch without float8_e8m0fnu")
def test_fp8_block_with_e8m0_scales():
    stack = make_stack("fp8_block", 2, 33, 160, seed=2, scale_dtype=torch.float8_e8m0fnu)
    x = torch.randn(20, 160, generator=torch.Generator().manual_seed(1))
    ends = [7, 20]
    with torch.no_grad():
        check_close(quantized_grouped_linear(x, ends, stack), x, torch.tensor(ends), stack, None)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_nvfp4_rows_of_an_odd_number_of_blocks(kernels):
    # 48 values: the kernels' last 32-value step holds one 16-value block.
    stack = make_stack("nvfp4", 2, 19, 48, seed=8)
    x = torch.randn(33, 48, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ends = torch.tensor([10, 30], dtype=torch.int32)
    with using_quantized_linear_kernels(kernels), torch.no_grad():
        check_close(quantized_grouped_linear(x, ends, stack), x, ends.long(), stack, None)


def test_row_strided_rows_and_list_ends():
    stack = make_stack("mxfp4", 2, 50, 96, seed=1)
    wide = torch.randn(30, 200, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = wide[:, 10:106]  # rows 200 apart, read in place
    bias = torch.randn(2, 50, dtype=torch.float64)
    with torch.no_grad():
        got = quantized_grouped_linear(x, [12, 25], stack, bias)
    check_close(got, x, torch.tensor([12, 25]), stack, bias)


def test_inputs_not_changed():
    stack = make_stack("nvfp4", 2, 40, 64, seed=3)
    before = {name: t.clone() for name, t in stack.tensors().items()}
    x = torch.randn(10, 64)
    x_before = x.clone()
    quantized_grouped_linear(x, [4, 10], stack)
    assert torch.equal(x, x_before)
    for name, t in stack.tensors().items():
        assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), name


# ---- W8A8: activation_group -------------------------------------------------------------------

def w8a8_rows(rows, features, dtype, seed):
    """Random rows scaled in turn by 0 (a zero row: scale 0), a tiny factor (float32 / bfloat16:
    below 448e-12, where the divisor's floor 1e-12 takes over), 1 and a big factor."""
    tiny, big = (2.0 ** -20, 64.0) if dtype == torch.float16 else (1e-20, 1e25)
    factors = torch.tensor([0.0, tiny, 1.0, big], dtype=torch.float64).repeat(rows // 4 + 1)[:rows, None]
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x * factors).to(dtype)


def tie_rich_rows(rows, group, dtype, seed):
    """Rows whose groups each start with 448, so that every scale is 1 and the codes are E4M3's
    rounding of the values themselves, the others drawn from values with 1 to 5 significant bits
    at every binade E4M3 holds and below it (exact ties between E4M3 neighbours among them)."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-13, 9, (rows, group), generator=generator).double()
    mantissas = torch.randint(16, 32, (rows, group), generator=generator).double() / 16
    signs = torch.randint(0, 2, (rows, group), generator=generator).double() * 2 - 1
    x = (signs * mantissas * torch.exp2(exponents)).clamp(-448, 448)
    x[:, 0] = 448
    return x.to(dtype)


def w8a8_reference(rows, ends, stack, bias, group):
    """dynamic_activations' rows (in float64: codes * scale exactly) through the float64 reference."""
    return reference(dynamic_activations(rows, group, torch.float64), ends, stack, bias)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
@pytest.mark.parametrize("block, group", [((128, 128), 128), ((16, 32), 32), ((48, 24), 48), ((7, 7), 200)])
def test_w8a8_quantizes_the_rows_as_dynamic_activations(kernels, dtype, block, group):
    """activation_group: the rows quantized exactly as dynamic_activations quantizes them (the same
    operator on its float32 rows gives the same bits), and the products within float32 rounding of
    the float64 reference over those rows.  K = 200: 128-wide groups end with a partial one."""
    stack = make_stack("fp8_block", 3, 45, 200, seed=group, block=block)
    x = w8a8_rows(70, 200, dtype, seed=group)
    ends = make_ends(70, 3, seed=group + 1)
    bias = torch.randn(3, 45, generator=torch.Generator().manual_seed(2)) if group != 32 else None
    with using_quantized_linear_kernels(kernels), torch.no_grad():
        got = quantized_grouped_linear(x, ends, stack, bias, activation_group=group)
        quantized = dynamic_activations(x, group, torch.float32)
        assert torch.equal(got, quantized_grouped_linear(quantized, ends, stack, bias).to(dtype))
    expected, magnitude = w8a8_reference(x, ends, stack, bias, group)
    to_sum, to_out = TOLERANCES[torch.float32][0], TOLERANCES[dtype][1]
    error = (got.double() - expected).abs()
    spacing = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the dtype's subnormals' spacing
    assert (error <= to_sum * magnitude + to_out * expected.abs() + spacing).all()
    assert torch.count_nonzero(got[int(ends[-1]):]) == 0


@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
def test_w8a8_rounds_to_e4m3_as_pytorch(dtype):
    """Scales of 1 (each group's amax 448): the codes are PyTorch's float8_e4m3fn conversion of the
    values, ties included; a code off anywhere changes the products' bits."""
    stack = make_stack("fp8_block", 2, 29, 256, seed=3)
    x = tie_rich_rows(40, 128, dtype, seed=5).repeat(1, 2)
    ends = torch.tensor([17, 40])
    with torch.no_grad():
        got = quantized_grouped_linear(x, ends, stack, activation_group=128)
        codes = x.float().to(torch.float8_e4m3fn).float()
        assert torch.equal(dynamic_activations(x, 128, torch.float32), codes)
        assert torch.equal(got, quantized_grouped_linear(codes, ends, stack).to(dtype))


@pytest.mark.parametrize("group, error, match", [
    (-1, ValueError, "`activation_group` must be 0"),
    (24, ValueError, "multiple of 16 or at least K = 200"),
    (1.5, TypeError, "`activation_group` must be an int"),
])
def test_bad_activation_groups_are_named(group, error, match):
    stack = make_stack("fp8_block", 2, 9, 200, seed=1)
    with pytest.raises(error, match=match):
        quantized_grouped_linear(torch.randn(4, 200), [2, 4], stack, activation_group=group)


def test_w8a8_needs_a_block_fp8_stack():
    x, ends, stack = good_call()
    with pytest.raises(ValueError, match="`activation_group` = 64 .* needs an Fp8BlockWeights"):
        quantized_grouped_linear(x, ends, stack, activation_group=64)
    with pytest.raises(ValueError, match="`activation_group` = 64 .* needs format 'fp8_block'"):
        torch.ops.tutel.quantized_grouped_linear(x, ends, "mxfp4", stack.packed, stack.scales, None, [], None, 64)
    fp8 = make_stack("fp8_block", 2, 9, 200, seed=1)
    with pytest.raises(ValueError, match="multiple of 16 or at least K = 200"):
        torch.ops.tutel.quantized_grouped_linear(torch.randn(4, 200), torch.tensor([2, 4]), "fp8_block", fp8.weight,
                                                 fp8.scale_inv, None, [128, 128], None, 100)


# ---- bad input --------------------------------------------------------------------------------

def good_call():
    stack = make_stack("mxfp4", 3, 20, 64, seed=0)
    return torch.randn(10, 64), torch.tensor([3, 3, 9]), stack


@pytest.mark.parametrize("change, error, match", [
    (lambda x, e, s: (x.double(), e, s), TypeError, "`rows` must be float32, bfloat16 or float16"),
    (lambda x, e, s: (x[None], e, s), ValueError, "rows"),
    (lambda x, e, s: (x[:, :32], e, s), ValueError, "must have the 64 features"),
    (lambda x, e, s: (x, e.float(), s), TypeError, "`ends` must be int32 or int64"),
    (lambda x, e, s: (x, e[:2], s), ValueError, r"`ends` must be \[3\]"),
    (lambda x, e, s: (x, torch.tensor([3, 2, 9]), s), ValueError, "non-decreasing"),
    (lambda x, e, s: (x, torch.tensor([3, 3, 11]), s), ValueError, r"within \[0, 10\]"),
    (lambda x, e, s: (x, torch.tensor([-1, 3, 9]), s), ValueError, "non-decreasing"),
    (lambda x, e, s: (x, [3, 3.0, 9], s), TypeError, "sequence of ints"),
    (lambda x, e, s: (x, e, s.dequantize_reference(torch.float32)), TypeError, "tutel.quant"),
])
def test_bad_input_is_named(change, error, match):
    x, ends, stack = change(*good_call())
    with pytest.raises(error, match=match):
        quantized_grouped_linear(x, ends, stack)


def test_bad_bias_is_named():
    x, ends, stack = good_call()
    with pytest.raises(ValueError, match=r"`bias` must be \[3, 20\], got \[3, 19\]"):
        quantized_grouped_linear(x, ends, stack, torch.zeros(3, 19))
    with pytest.raises(TypeError, match="bias"):
        quantized_grouped_linear(x, ends, stack, torch.zeros(3, 20, dtype=torch.int32))


def test_a_gradient_is_refused():
    x, ends, stack = good_call()
    with pytest.raises(RuntimeError, match="no backward"):
        quantized_grouped_linear(x.requires_grad_(), ends, stack)
    with torch.no_grad():
        quantized_grouped_linear(x, ends, stack)


def test_the_operator_checks_its_own_arguments():
    x, ends, stack = good_call()
    op = torch.ops.tutel.quantized_grouped_linear
    with pytest.raises(ValueError, match="not a weight format"):
        op(x, ends, "int4", stack.packed, stack.scales, None, [], None)
    with pytest.raises(ValueError, match="non-decreasing"):
        op(x, torch.tensor([5, 3, 9]), "mxfp4", stack.packed, stack.scales, None, [], None)
    with pytest.raises(ValueError, match="`scales` must be"):
        op(x, ends, "mxfp4", stack.packed, stack.scales[:, :, :1], None, [], None)
    with pytest.raises(ValueError, match="`block` is fp8_block's"):
        op(x, ends, "mxfp4", stack.packed, stack.scales, None, [128, 128], None)
    with pytest.raises(ValueError, match="features"):
        op(x[:, :32], ends, "mxfp4", stack.packed, stack.scales, None, [], None)


def test_an_unknown_kernel_set_is_named():
    with pytest.raises(ValueError, match="not a kernel set this CPU runs"):
        set_quantized_linear_kernels("sse9")
    assert quantized_linear_kernels() == KERNEL_SETS[0]


# ---- the decoding's special cases (bfloat16 rows) ---------------------------------------------

def exact_bf16_weights_check(got, rows, ends, rounded):
    """got against the float64 product of rows with `rounded` (each weight as bfloat16 holds it),
    to the float32 sums' and the output's rounding only: a weight decoded one bfloat16 step off
    fails it.  Weights below bfloat16's normal range may count as zero (AMX's bfloat16 products
    take subnormal inputs as zero): their terms are allowed whole."""
    x = rows.double()
    subnormal = torch.where(rounded.abs() < 2.0 ** -126, rounded, torch.zeros_like(rounded))
    start = 0
    for expert, end in enumerate(ends.tolist()):
        expected = x[start:end] @ rounded[expert].t()
        magnitude = x[start:end].abs() @ rounded[expert].abs().t()
        slack = x[start:end].abs() @ subnormal[expert].abs().t()
        error = (got[start:end].double() - expected).abs()
        bound = 2 ** -8 * expected.abs() + 2 ** -16 * magnitude + slack * (1 + 2 ** -8) + 1e-300
        assert (error <= bound).all(), f"expert {expert}: error {(error / bound).max().item():.3g}x the bound"
        start = end


@pytest.mark.parametrize("scale_bytes, x_scale", [((2, 3, 4), 2.0 ** 100), ((250, 251, 252, 253, 254), 2.0 ** -110),
                                                  ((100, 127, 150), 1.0), ((0, 1, 2, 127), 2.0 ** 100)])
def test_mxfp4_scales_at_the_ends_of_bfloat16s_range(scale_bytes, x_scale):
    # E8M0 scales near bfloat16's range ends, where an exponent added to the codes' bits would leave
    # it; every code (zero and negative zero among them), magnitudes cut where the value would
    # overflow float32 (scale 253: up to 3, 254: up to 1.5).  MXFP4 values are exact in bfloat16.
    experts, outputs, features = 2, 37, 128
    generator = torch.Generator().manual_seed(sum(scale_bytes))
    choices = torch.tensor(scale_bytes, dtype=torch.uint8)
    scales = choices[torch.randint(0, len(scale_bytes), (experts, outputs, features // 32), generator=generator)]
    largest_code = torch.where(scales.long() >= 254, 3, torch.where(scales.long() == 253, 5, 7))
    largest_code = largest_code.repeat_interleave(32, dim=2)  # per element
    magnitude = torch.randint(0, 8, (experts, outputs, features), generator=generator) % (largest_code + 1)
    sign = torch.randint(0, 2, (experts, outputs, features), generator=generator) * 8
    codes = (magnitude + sign).to(torch.uint8)
    stack = Mxfp4Weights(codes[..., 0::2] | (codes[..., 1::2] << 4), scales)
    x = (torch.randn(40, features, generator=generator) * x_scale).to(torch.bfloat16)
    ends = torch.tensor([17, 40])
    with torch.no_grad():
        got = quantized_grouped_linear(x, ends, stack)
    assert torch.isfinite(got).all()
    exact_bf16_weights_check(got, x, ends, stack.dequantize_reference(torch.float64))


@pytest.mark.parametrize("global_scale", [0.01, 3e-36, 1e-39, 1e30])
def test_nvfp4_factors_near_float32s_range_ends(global_scale):
    # scale * global products from subnormal to huge: each weight is code * (scale * global), both
    # products in float32, rounded to bfloat16 once.
    packed = make_stack("nvfp4", 2, 33, 80, seed=4)
    stack = Nvfp4Weights(packed.packed, packed.block_scales, torch.full((2,), global_scale))
    x = (torch.randn(30, 80, generator=torch.Generator().manual_seed(5)) / global_scale ** 0.5).to(torch.bfloat16)
    ends = torch.tensor([12, 30])
    with torch.no_grad():
        got = quantized_grouped_linear(x, ends, stack)
    low, high = packed.packed & 15, packed.packed >> 4
    codes = torch.stack([low, high], dim=-1).flatten(-2).long()
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = e2m1[codes % 8] * (1 - 2 * (codes // 8)).float()
    factors = (stack.block_scales.float() * torch.tensor(global_scale, dtype=torch.float32)).repeat_interleave(16, 2)
    exact_bf16_weights_check(got, x, ends, (values * factors).to(torch.bfloat16).double())


@pytest.mark.parametrize("scale", [1e-3, 0.0, 1e-35, 1e-30, 1e35, -2.5])
def test_fp8_block_scales_near_float32s_range_ends(scale):
    # block scales from zero and subnormal products to huge ones, negative too: each weight is
    # code * scale in float32, rounded to bfloat16 once.
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (2, 40, 96), dtype=torch.uint8, generator=generator)
    codes[(codes & 0x7f) == 0x7f] = 0x3c  # no NaN codes
    scales = torch.full((2, 1, 1), scale) * (1 + torch.rand(2, 1, 1, generator=generator))
    stack = Fp8BlockWeights(codes.view(torch.float8_e4m3fn), scales, block=(128, 128))
    x = (torch.randn(20, 96, generator=generator) / max(abs(scale), 1e-30) ** 0.5).to(torch.bfloat16)
    ends = torch.tensor([9, 20])
    with torch.no_grad():
        got = quantized_grouped_linear(x, ends, stack)
    weights = (codes.view(torch.float8_e4m3fn).float() * scales.float()).to(torch.bfloat16).double()
    exact_bf16_weights_check(got, x, ends, weights)
