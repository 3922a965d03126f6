"""tutel.quant's expert stacks: built from checkpoint tensors, decoded as the specifications say
(compared element by element with quant_spec's decoders), sliced by experts, moved, stored.

The comparisons with transformers' own dequantizers are in test_quant_transformers.py, the
quantizers in test_quant_quantizers.py, bad input in test_quant_bad_input.py."""
import io
import math

import pytest
import torch

import quant_spec
from tutel.quant import FORMATS, Fp8BlockWeights, GateUpRows, Mxfp4Weights, Nvfp4Weights, QuantizedWeights
from tutel.quant.codes import FLOAT4_E2M1FN_X2, FLOAT8_E8M0FNU

# scale dtypes of the fp8 blocks this PyTorch has (float8_e8m0fnu since 2.7)
FP8_SCALE_DTYPES = [torch.float32, torch.bfloat16] + ([FLOAT8_E8M0FNU] if FLOAT8_E8M0FNU is not None else [])


def random_fp8_scales(shape, dtype):
    """Random valid block scales: log-uniform positive values in float32 / bfloat16, or E8M0 bytes."""
    if dtype == FLOAT8_E8M0FNU:
        return quant_spec.random_e8m0(shape).view(dtype)
    return torch.exp2(torch.empty(shape).uniform_(-20, 20)).to(dtype)


def scale_values(scale_inv):
    """The scales as nested Python floats, decoded here (E8M0 from its bytes)."""
    if scale_inv.dtype == FLOAT8_E8M0FNU:
        return [[[quant_spec.e8m0_value(b) for b in row] for row in matrix]
                for matrix in scale_inv.view(torch.uint8).tolist()]
    return scale_inv.to(torch.float64).tolist()


def fp8_stack(experts=2, rows=7, columns=13, block=(4, 8), scale_dtype=torch.float32, **kwargs):
    weight = quant_spec.random_e4m3_bytes((experts, rows, columns))
    grid = (math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    return Fp8BlockWeights(weight, random_fp8_scales((experts,) + grid, scale_dtype), block=block, **kwargs)


def mxfp4_stack(experts=2, rows=5, columns=64, **kwargs):
    return Mxfp4Weights(quant_spec.random_packed((experts, rows, columns // 2)),
                        quant_spec.random_e8m0((experts, rows, columns // 32)), **kwargs)


def nvfp4_stack(experts=2, rows=5, columns=48, **kwargs):
    block_scales = quant_spec.random_e4m3_bytes((experts, rows, columns // 16))
    global_scales = torch.exp2(torch.empty(experts).uniform_(-10, 10)).to(torch.float32)
    return Nvfp4Weights(quant_spec.random_packed((experts, rows, columns // 2)), block_scales, global_scales,
                        **kwargs)


STACKS = {"fp8_block": fp8_stack, "mxfp4": mxfp4_stack, "nvfp4": nvfp4_stack}


def assert_bitwise_equal(actual, expected):
    """Equal values, NaN where NaN, and the same sign of every zero."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(actual[keep], expected[keep])
    assert torch.equal(torch.signbit(actual[keep]), torch.signbit(expected[keep]))


# -- the decoders against the specification, element by element ------------------------------------

@pytest.mark.parametrize("scale_dtype", FP8_SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("experts, rows, columns, block", [
    (2, 7, 13, (4, 8)),     # odd sizes, partial last blocks in both directions
    (1, 9, 200, (2, 128)),  # K = 200 over 128-column blocks: one full, one partial
    (3, 8, 16, (8, 16)),    # exact blocks
    (1, 5, 3, (128, 128)),  # one partial block
])
def test_fp8_block_decodes_as_the_block_rule(experts, rows, columns, block, scale_dtype):
    stack = fp8_stack(experts, rows, columns, block, scale_dtype)
    expected = quant_spec.decode_fp8_block(stack.weight, scale_values(stack.scale_inv), block)
    assert_bitwise_equal(stack.dequantize_reference(), expected)
    assert stack.shape == (experts, rows, columns) and stack.block == block and stack.scale_dtype == scale_dtype


@pytest.mark.parametrize("experts, rows, columns", [(1, 1, 32), (2, 5, 64), (3, 7, 96)])
def test_mxfp4_decodes_as_ocp_mx(experts, rows, columns):
    stack = mxfp4_stack(experts, rows, columns)
    expected = quant_spec.decode_mxfp4(stack.packed, stack.scales)
    assert_bitwise_equal(stack.dequantize_reference(), expected)
    assert stack.shape == (experts, rows, columns)


@pytest.mark.parametrize("experts, rows, columns", [(1, 1, 16), (2, 5, 48), (3, 3, 32)])
def test_nvfp4_decodes_as_the_two_level_rule(experts, rows, columns):
    stack = nvfp4_stack(experts, rows, columns)
    expected = quant_spec.decode_nvfp4(stack.packed, stack.block_scales, stack.global_scales)
    assert_bitwise_equal(stack.dequantize_reference(), expected)
    assert stack.shape == (experts, rows, columns)


def test_the_fp8_e4m3_nan_codes_decode_to_nan():
    weight = torch.tensor([[[0x7F, 0xFF, 0x7E, 0xFE]]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    stack = Fp8BlockWeights(weight, torch.ones(1, 1, 1), block=(1, 4))
    values = stack.dequantize_reference()[0, 0]
    assert values[:2].isnan().all() and values[2:].tolist() == [448.0, -448.0]


def test_every_mx_scale_byte_decodes_to_its_power_of_two():
    scales = torch.arange(255, dtype=torch.uint8).view(255, 1, 1).expand(255, 1, 1).contiguous()
    packed = torch.full((255, 1, 16), 0x72, dtype=torch.uint8)  # element 0: code 2 (1.0), element 1: code 7 (6.0)
    values = Mxfp4Weights(packed, scales).dequantize_reference()
    powers = torch.tensor([math.ldexp(1.0, b - 127) for b in range(255)], dtype=torch.float64)
    assert torch.equal(values[:, 0, 0], powers) and torch.equal(values[:, 0, 1], 6 * powers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", sorted(STACKS))
def test_the_reference_rounds_the_exact_values_once(fmt, dtype):
    stack = STACKS[fmt]()
    exact = stack.dequantize_reference()
    assert_bitwise_equal(stack.dequantize_reference(dtype), exact.to(dtype))


# -- layouts ----------------------------------------------------------------------------------------

def test_gpt_oss_blocks_and_the_packed_layout_are_one_stack():
    blocks = quant_spec.random_packed((3, 6, 2, 16))
    scales = quant_spec.random_e8m0((3, 6, 2))
    from_blocks = Mxfp4Weights(blocks, scales, gate_up_rows="interleaved")
    from_packed = Mxfp4Weights(blocks.reshape(3, 6, 32), scales, gate_up_rows="interleaved")
    assert from_blocks.packed.shape == (3, 6, 32) and from_blocks.in_features == 64
    assert torch.equal(from_blocks.packed, from_packed.packed)
    assert torch.equal(from_blocks.gpt_oss_blocks(), blocks)
    assert_bitwise_equal(from_blocks.dequantize_reference(), quant_spec.decode_mxfp4(blocks.reshape(3, 6, 32), scales))


def test_non_contiguous_gpt_oss_blocks_are_taken_as_their_values():
    blocks = quant_spec.random_packed((2, 16, 3, 4)).transpose(1, 3)  # (2, 4, 3, 16), not contiguous
    scales = quant_spec.random_e8m0((2, 4, 3))
    stack = Mxfp4Weights(blocks, scales)
    assert torch.equal(stack.packed, blocks.contiguous().view(2, 4, 48))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_the_packed_bytes_may_be_int8_or_float4(fmt):
    stack = STACKS[fmt]()
    tensors = stack.tensors()
    dtypes = [torch.int8] + ([FLOAT4_E2M1FN_X2] if FLOAT4_E2M1FN_X2 is not None else [])
    for dtype in dtypes:
        other = type(stack)(**dict(tensors, packed=tensors["packed"].view(dtype)), **stack.metadata())
        assert other.packed.dtype == torch.uint8 and torch.equal(other.packed, stack.packed)


def test_mx_scales_may_be_uint8_or_float8_e8m0fnu():
    stack = mxfp4_stack()
    # float8_e8m0fnu ships in PyTorch 2.7: older releases hold E8M0 as uint8 only
    for dtype in [torch.uint8] + ([FLOAT8_E8M0FNU] if FLOAT8_E8M0FNU is not None else []):
        other = Mxfp4Weights(stack.packed, stack.scales.view(dtype))
        assert other.scales.dtype == torch.uint8 and torch.equal(other.scales, stack.scales)


def test_nvfp4_from_modelopt_stacks_the_experts():
    stack = nvfp4_stack(experts=3, rows=6)
    weights = [stack.packed[e] for e in range(3)]
    scales = [stack.block_scales[e] for e in range(3)]
    globals_ = [stack.global_scales[e].clone().reshape(()) for e in range(3)]  # ModelOpt's scalar
    built = Nvfp4Weights.from_modelopt(weights, scales, globals_, gate_up_rows="concatenated")
    assert_bitwise_equal(built.dequantize_reference(), stack.dequantize_reference())
    assert built.gate_up_rows is GateUpRows.CONCATENATED


@pytest.mark.parametrize("rows_kind, gate, up", [
    ("concatenated", [0, 1, 2], [3, 4, 5]),
    ("interleaved", [0, 2, 4], [1, 3, 5]),
])
def test_gate_and_up_rows_name_the_rows(rows_kind, gate, up):
    for fmt, make in STACKS.items():
        stack = make(rows=6, gate_up_rows=rows_kind)
        gate_rows, up_rows = stack.gate_and_up_rows()
        assert list(range(6))[gate_rows] == gate and list(range(6))[up_rows] == up, fmt
        assert stack.gate_up_rows == GateUpRows(rows_kind) and stack.gate_up_rows == rows_kind
        assert stack.metadata()["gate_up_rows"] == rows_kind


def test_a_matrix_without_gate_and_up_has_no_rows_to_name():
    stack = mxfp4_stack()
    assert stack.gate_up_rows is None
    with pytest.raises(ValueError, match="no fused gate/up matrix"):
        stack.gate_and_up_rows()


# -- the common interface ---------------------------------------------------------------------------

def test_the_formats_are_registered_by_name():
    assert set(FORMATS) == {"fp8_block", "mxfp4", "nvfp4"}
    for name, cls in FORMATS.items():
        assert cls.format == name and issubclass(cls, QuantizedWeights)


@pytest.mark.parametrize("fmt", sorted(STACKS))
def test_packed_bytes_count_every_tensor(fmt):
    stack = STACKS[fmt](experts=3)
    actual = sum(t.untyped_storage().nbytes() for t in stack.tensors().values())
    assert stack.packed_bytes() == actual
    experts, rows, columns = stack.shape
    expected = {
        "fp8_block": experts * rows * columns + experts * math.ceil(rows / 4) * math.ceil(columns / 8) * 4,
        "mxfp4": experts * rows * columns // 2 + experts * rows * columns // 32,
        "nvfp4": experts * rows * columns // 2 + experts * rows * columns // 16 + 4 * experts,
    }[fmt]
    assert stack.packed_bytes() == expected


@pytest.mark.parametrize("scale_dtype", FP8_SCALE_DTYPES, ids=str)
def test_fp8_packed_bytes_follow_the_scale_dtype(scale_dtype):
    stack = fp8_stack(experts=2, rows=7, columns=13, block=(4, 8), scale_dtype=scale_dtype)
    size = torch.empty((), dtype=scale_dtype).element_size()
    assert stack.packed_bytes() == 2 * 7 * 13 + 2 * 2 * 2 * size


@pytest.mark.parametrize("fmt", sorted(STACKS))
def test_selected_experts_are_those_experts(fmt):
    stack = STACKS[fmt](experts=5)
    full = stack.dequantize_reference()
    for ids in ([4, 0, 2], torch.tensor([3, 3, 1]), (1,), []):
        picked = stack.select_experts(ids)
        index = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.int64)
        assert picked.experts == len(index) and picked.shape[1:] == stack.shape[1:]
        assert_bitwise_equal(picked.dequantize_reference(), full[index])
        assert type(picked) is type(stack) and picked.metadata() == stack.metadata()
    sliced = stack.select_experts(slice(1, 5, 2))
    assert_bitwise_equal(sliced.dequantize_reference(), full[1:5:2])
    # a slice gives views of the stack's tensors, not copies
    for name, tensor in sliced.tensors().items():
        assert tensor.untyped_storage().data_ptr() == stack.tensors()[name].untyped_storage().data_ptr()
    for e in range(5):
        assert_bitwise_equal(stack.expert(e).dequantize_reference(), full[e:e + 1])


@pytest.mark.parametrize("fmt", sorted(STACKS))
def test_a_stack_moves_between_devices(fmt):
    stack = STACKS[fmt](gate_up_rows="concatenated", rows=6)
    moved = stack.to("meta")
    assert moved.device.type == "meta" and moved.shape == stack.shape
    assert all(t.device.type == "meta" for t in moved.tensors().values())
    assert {k: t.dtype for k, t in moved.tensors().items()} == {k: t.dtype for k, t in stack.tensors().items()}
    back = stack.to(torch.device("cpu"))
    assert_bitwise_equal(back.dequantize_reference(), stack.dequantize_reference())
    assert moved.metadata() == stack.metadata() and stack.device.type == "cpu"


@pytest.mark.parametrize("fmt", sorted(STACKS))
def test_a_stack_survives_a_state_dict(fmt):
    stack = STACKS[fmt](gate_up_rows="interleaved", rows=4)
    buffer = io.BytesIO()
    torch.save(stack.tensors(), buffer)
    buffer.seek(0)
    loaded = type(stack)(**torch.load(buffer), **stack.metadata())
    assert_bitwise_equal(loaded.dequantize_reference(), stack.dequantize_reference())
    assert loaded.metadata() == stack.metadata()
    assert repr(loaded) == repr(stack) and fmt in type(stack).format


@pytest.mark.parametrize("fmt", sorted(STACKS))
def test_zero_experts_make_an_empty_stack(fmt):
    stack = STACKS[fmt](experts=0)
    assert stack.experts == 0 and stack.packed_bytes() == 0
    assert stack.dequantize_reference().shape == (0,) + stack.shape[1:]
    assert stack.select_experts([]).experts == 0


def test_sixty_four_experts():
    stack = mxfp4_stack(experts=64, rows=3, columns=32)
    expected = quant_spec.decode_mxfp4(stack.packed, stack.scales)
    assert_bitwise_equal(stack.dequantize_reference(), expected)
    shard = stack.select_experts(range(16, 32))  # one process' share of 4
    assert_bitwise_equal(shard.dequantize_reference(), expected[16:32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", sorted(STACKS))
def test_stacks_on_cuda_decode_and_quantize_as_on_the_cpu(fmt):
    stack = STACKS[fmt](experts=4, rows=6, gate_up_rows="interleaved")
    on_cuda = stack.to("cuda")
    assert on_cuda.device.type == "cuda"
    assert_bitwise_equal(on_cuda.dequantize_reference().cpu(), stack.dequantize_reference())
    picked = on_cuda.select_experts(torch.tensor([3, 1], device="cuda"))
    assert_bitwise_equal(picked.dequantize_reference().cpu(), stack.dequantize_reference()[[3, 1]])
    quantize = {"fp8_block": lambda w: Fp8BlockWeights.quantize(w, block=(4, 8)),
                "mxfp4": Mxfp4Weights.quantize, "nvfp4": Nvfp4Weights.quantize}[fmt]
    weight = torch.randn(3, 5, 64, dtype=torch.float64)
    assert_bitwise_equal(quantize(weight.cuda()).dequantize_reference().cpu(), quantize(weight).dequantize_reference())
