"""The quantizers of tutel.quant: code for code what quant_spec's element-by-element quantizers give,
errors within each format's rounding bound, exact on values the format holds, and stable:
dequantize(quantize(dequantize(q))) == dequantize(q)."""
import math

import pytest
import torch

import quant_spec
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights
from tutel.quant.codes import FLOAT8_E8M0FNU

FP8_SCALE_KINDS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
if FLOAT8_E8M0FNU is not None:
    FP8_SCALE_KINDS["ue8m0"] = FLOAT8_E8M0FNU


def spread_weights(shape, dtype=torch.float64):
    """Random weights whose rows span many binades (blocks get distinct scales), with one all-zero
    (4 x 32) corner in the first expert."""
    experts, rows, columns = shape
    weight = torch.randn(shape, dtype=torch.float64) * torch.exp2(torch.randint(-12, 12, (experts, rows, 1)).double())
    if experts:
        weight[0, :4, :32] = 0
    return weight.to(dtype)


def assert_same_values(actual, expected):
    """Bitwise equal float64 stacks (zero signs too)."""
    assert torch.equal(actual, expected) and torch.equal(torch.signbit(actual), torch.signbit(expected))


def fp8_scale_values(scale_inv):
    if scale_inv.dtype == FLOAT8_E8M0FNU:
        return [[[quant_spec.e8m0_value(b) for b in row] for row in m] for m in scale_inv.view(torch.uint8).tolist()]
    return scale_inv.to(torch.float64).tolist()


# -- code for code against the specification ---------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(FP8_SCALE_KINDS))
@pytest.mark.parametrize("shape, block", [((2, 7, 45), (4, 32)), ((1, 5, 200), (2, 128)), ((3, 8, 32), (8, 16))])
def test_fp8_block_quantizer_follows_the_spec(shape, block, kind):
    weight = spread_weights(shape)
    stack = Fp8BlockWeights.quantize(weight, block=block, scale_dtype=FP8_SCALE_KINDS[kind])
    codes, scales = quant_spec.quantize_fp8_block(weight, block, kind)
    assert stack.scale_inv.dtype == FP8_SCALE_KINDS[kind] and stack.block == block
    assert fp8_scale_values(stack.scale_inv) == scales
    assert torch.equal(stack.weight.view(torch.uint8), codes)


@pytest.mark.parametrize("shape", [(2, 5, 64), (1, 3, 96), (1, 1, 32)])
def test_mxfp4_quantizer_follows_ocp_mx(shape):
    weight = spread_weights(shape)
    if shape[0] > 1:
        weight[1, 0, :32] *= 1e-36   # a shared exponent below -127: clamped
    stack = Mxfp4Weights.quantize(weight)
    codes, scales = quant_spec.quantize_mxfp4(weight)
    assert torch.equal(stack.scales, scales)
    assert torch.equal(quant_spec.unpack_codes(stack.packed), codes)


@pytest.mark.parametrize("shape", [(2, 5, 48), (1, 3, 16), (3, 2, 32)])
def test_nvfp4_quantizer_follows_the_two_level_rule(shape):
    weight = spread_weights(shape)
    weight[-1] = 0  # an all-zero expert: global scale 1
    stack = Nvfp4Weights.quantize(weight)
    codes, block_scales, global_scales = quant_spec.quantize_nvfp4(weight)
    assert stack.global_scales.tolist() == global_scales and global_scales[-1] == 1.0
    assert torch.equal(stack.block_scales.view(torch.uint8), block_scales)
    assert torch.equal(quant_spec.unpack_codes(stack.packed), codes)


# -- the rounding bound on larger stacks ------------------------------------------------------------

def blockwise_amax(weight, block):
    """(E, ceil(N / b0), ceil(K / b1)) largest magnitudes, partial blocks included."""
    experts, rows, columns = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    padded = weight.new_zeros((experts, grid[0] * block[0], grid[1] * block[1]))
    padded[:, :rows, :columns] = weight.abs()
    return padded.view(experts, grid[0], block[0], grid[1], block[1]).amax(dim=(2, 4))


def expand(scales, block, rows, columns):
    return scales.repeat_interleave(block[0], 1)[:, :rows].repeat_interleave(block[1], 2)[:, :, :columns]


@pytest.mark.parametrize("kind", sorted(FP8_SCALE_KINDS))
def test_fp8_block_error_is_within_half_an_e4m3_step(kind):
    block, weight = (128, 128), spread_weights((3, 130, 200))
    stack = Fp8BlockWeights.quantize(weight, block=block, scale_dtype=FP8_SCALE_KINDS[kind])
    amax = blockwise_amax(weight, block)
    if kind == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
        scale = torch.where(amax > 448 * scale, 2 * scale, scale)
    else:
        scale = (amax / 448).to(FP8_SCALE_KINDS[kind]).to(torch.float64)
    scale = expand(torch.where(amax == 0, 1.0, scale), block, 130, 200)
    # E4M3: relative half step 2^-4 among the normals, 2^-10 (in units of the scale) among the subnormals
    bound = torch.maximum(weight.abs() * 2.0 ** -4, scale * 2.0 ** -10)
    assert bool(((stack.dequantize_reference() - weight).abs() <= within_rounding(bound)).all())


def within_rounding(bound):
    """The bound, widened by float64's rounding of the test's own arithmetic (|w| - 6 * step and
    step * (|w| / step - 6) may differ in the last bit)."""
    return bound * (1 + 2.0 ** -40)


def test_mxfp4_error_is_within_half_an_e2m1_step():
    weight = spread_weights((4, 33, 256))
    stack = Mxfp4Weights.quantize(weight)
    blocks = weight.view(4, 33, 8, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(amax == 0, 0.0, torch.floor(torch.log2(amax)) - 2)
    step = torch.exp2(exponent)
    bound = (step * quant_spec.half_step_bound(blocks.abs() / step)).view(4, 33, 256)
    error = (stack.dequantize_reference() - weight).abs()
    assert bool((error <= within_rounding(bound)).all())
    assert float(error.max()) > 0  # the bound is tested, not trivially met


def test_nvfp4_error_is_within_half_an_e2m1_step():
    weight = spread_weights((3, 21, 128))
    stack = Nvfp4Weights.quantize(weight)
    blocks = weight.view(3, 21, 8, 16)
    global_scale = [quant_spec.to_float32(float(weight[e].abs().max()) / 2688) for e in range(3)]
    block_scale = torch.tensor([[[quant_spec.e4m3fn_value(quant_spec.nearest_e4m3(float(b.abs().max()) / (6 * g)))
                                  for b in row] for row in blocks[e]] for e, g in enumerate(global_scale)],
                               dtype=torch.float64)
    step = (block_scale * torch.tensor(global_scale, dtype=torch.float64)[:, None, None]).unsqueeze(-1)
    safe = torch.where(step > 0, step, 1.0)
    bound = torch.where(step > 0, step * quant_spec.half_step_bound(blocks.abs() / safe), blocks.abs())
    assert bool(((stack.dequantize_reference() - weight).abs() <= within_rounding(bound.view(3, 21, 128))).all())


# -- exact on values the format holds, and stable ----------------------------------------------------

@pytest.mark.parametrize("kind", sorted(FP8_SCALE_KINDS))
def test_fp8_block_is_exact_on_representable_values(kind):
    """Blocks whose largest code is +-448 and whose scale the scale dtype holds come back unchanged."""
    experts, rows, columns, block = 2, 9, 200, (4, 128)
    codes = quant_spec.random_e4m3_bytes((experts, rows, columns)).view(torch.uint8).clone()
    codes[:, ::block[0], ::block[1]] = torch.tensor([0x7E, 0xFE], dtype=torch.uint8)[
        torch.randint(0, 2, codes[:, ::block[0], ::block[1]].shape)]  # +-448 at each block's first element
    codes = torch.where((codes & 0x7F) == 0x7E, codes, codes & 0xF7)  # and nothing else at or beyond it
    grid = (experts, 3, 2)
    if kind == "ue8m0":
        scales = torch.exp2(torch.randint(-100, 100, grid).double())
    else:
        scales = torch.exp2(torch.empty(grid).uniform_(-20, 20)).to(FP8_SCALE_KINDS[kind]).double()
    values = quant_spec.decode_fp8_block(codes.view(torch.float8_e4m3fn), scales.tolist(), block)
    stack = Fp8BlockWeights.quantize(values, block=block, scale_dtype=FP8_SCALE_KINDS[kind])
    assert fp8_scale_values(stack.scale_inv) == scales.tolist()
    assert torch.equal(stack.weight.view(torch.uint8), codes)
    assert_same_values(stack.dequantize_reference(), values)


def test_mxfp4_is_exact_on_every_decoded_stack():
    """Any MXFP4 stack's values quantize back to the same values (the codes may move to another scale)."""
    packed, scales = quant_spec.random_packed((3, 5, 32)), quant_spec.random_e8m0((3, 5, 2))
    values = Mxfp4Weights(packed, scales).dequantize_reference()
    assert_same_values(Mxfp4Weights.quantize(values).dequantize_reference(), values)


def test_nvfp4_is_exact_on_representable_values():
    """Blocks holding a +-6 code, E4M3 normal block scales, one of 448 per expert, float32 global scales."""
    experts, rows, columns = 3, 5, 64
    codes = torch.randint(0, 16, (experts, rows, columns), dtype=torch.uint8)
    codes[:, :, ::16] = torch.tensor([7, 15], dtype=torch.uint8)[torch.randint(0, 2, (experts, rows, columns // 16))]
    block_scales = torch.randint(0x08, 0x7F, (experts, rows, columns // 16), dtype=torch.uint8)  # normal, below NaN
    block_scales[:, 0, 0] = 0x7E  # 448
    global_scales = torch.exp2(torch.empty(experts).uniform_(-20, 20)).to(torch.float32)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    values = quant_spec.decode_nvfp4(packed, block_scales, global_scales)
    stack = Nvfp4Weights.quantize(values)
    assert torch.equal(stack.packed, packed) and torch.equal(stack.block_scales.view(torch.uint8), block_scales)
    assert torch.equal(stack.global_scales, global_scales)


QUANTIZERS = {
    **{f"fp8_block-{kind}": (lambda w, dtype=dtype: Fp8BlockWeights.quantize(w, block=(16, 32), scale_dtype=dtype))
       for kind, dtype in FP8_SCALE_KINDS.items()},
    "mxfp4": Mxfp4Weights.quantize,
    "nvfp4": Nvfp4Weights.quantize,
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_quantizing_a_quantized_stack_changes_nothing(name):
    """NVFP4 holds it where every block scale is an E4M3 normal number (block amax at least
    2^-6 / 448 of the matrix's): normal random weights, not rows spanning 2^24 (below that, a block
    scale rounded to a subnormal can leave the block's largest code under 6, and the second pass
    picks another scale)."""
    quantize = QUANTIZERS[name]
    weight = torch.randn(2, 37, 96, dtype=torch.float64) if name == "nvfp4" else spread_weights((2, 37, 96))
    once = quantize(weight).dequantize_reference()
    assert_same_values(quantize(once).dequantize_reference(), once)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_every_float_dtype_quantizes_as_its_float64_values(name, dtype):
    weight = spread_weights((2, 3, 64), dtype)
    quantize = QUANTIZERS[name]
    ours, wide = quantize(weight).tensors(), quantize(weight.to(torch.float64)).tensors()
    assert ours.keys() == wide.keys()
    assert all(torch.equal(ours[k].view(torch.uint8) if ours[k].element_size() == 1 else ours[k],
                           wide[k].view(torch.uint8) if wide[k].element_size() == 1 else wide[k]) for k in ours)


@pytest.mark.parametrize("experts", [0, 1, 64])
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_expert_counts_and_odd_rows(name, experts):
    weight = spread_weights((experts, 3, 64))
    stack = QUANTIZERS[name](weight)
    assert stack.shape == (experts, 3, 64)
    for e in range(0, experts, 21):  # each expert is quantized alone
        alone = QUANTIZERS[name](weight[e:e + 1]).dequantize_reference()
        assert_same_values(stack.expert(e).dequantize_reference(), alone)


def test_all_zero_weights_get_unit_scales_and_zero_codes():
    zeros = torch.zeros(2, 4, 32)
    fp8 = Fp8BlockWeights.quantize(zeros, block=(3, 20))
    assert bool((fp8.scale_inv == 1).all()) and not bool(fp8.weight.view(torch.uint8).any())
    mx = Mxfp4Weights.quantize(zeros)
    assert bool((mx.scales == 127).all()) and not bool(mx.packed.any())
    nv = Nvfp4Weights.quantize(zeros)
    assert nv.global_scales.tolist() == [1.0, 1.0] and not bool(nv.block_scales.view(torch.uint8).any())
    for stack in (fp8, mx, nv):
        assert_same_values(stack.dequantize_reference(), torch.zeros(2, 4, 32, dtype=torch.float64))


def test_the_quantizers_keep_the_gate_up_rows():
    weight = spread_weights((1, 4, 32))
    assert Fp8BlockWeights.quantize(weight, gate_up_rows="concatenated").gate_up_rows == "concatenated"
    assert Mxfp4Weights.quantize(weight, gate_up_rows="interleaved").gate_up_rows == "interleaved"
    assert Nvfp4Weights.quantize(weight, gate_up_rows="concatenated").gate_up_rows == "concatenated"
