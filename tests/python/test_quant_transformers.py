"""tutel.quant's reference dequantizers give bit for bit what transformers' own dequantizers give on
the same checkpoint tensors: gpt-oss' convert_moe_packed_tensors (MXFP4) and the block-FP8
dequantization of transformers' finegrained FP8 integration (FP8Experts' layout)."""
import math
import os

import pytest
import torch

import quant_spec
from tutel.quant import Fp8BlockWeights, Mxfp4Weights
from tutel.quant.codes import E2M1_VALUES, FLOAT8_E8M0FNU

if os.environ.get("CI") == "true":
    import transformers.integrations.mxfp4  # noqa: F401  (CI installs transformers: missing is an error)
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")

FP8_SCALE_DTYPES = [torch.float32, torch.bfloat16] + ([FLOAT8_E8M0FNU] if FLOAT8_E8M0FNU is not None else [])


def bits(tensor):
    """The tensor's bytes as integers: equal bits, NaN payloads and zero signs included."""
    return tensor.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[tensor.element_size()])


def test_the_e2m1_table_is_transformers_fp4_values():
    assert [math.copysign(1, v) for v in E2M1_VALUES] == [math.copysign(1, v) for v in mxfp4.FP4_VALUES]
    assert list(E2M1_VALUES) == list(mxfp4.FP4_VALUES)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("experts, rows, groups", [(1, 1, 1), (3, 7, 2), (2, 10, 5)])
def test_mxfp4_matches_gpt_oss_convert_moe_packed_tensors(experts, rows, groups, dtype):
    # every byte, every finite E8M0 scale (2^-127 .. 2^127: float32 and bfloat16 overflow to inf at the top, alike)
    blocks = quant_spec.random_packed((experts, rows, groups, 16))
    scales = quant_spec.random_e8m0((experts, rows, groups))
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, K, N): gpt-oss' x @ W layout
    # transformers 5.24's Mxfp4GptOssExperts holds the same bytes as (E, N, K / 2)
    for packed in (blocks, blocks.reshape(experts, rows, groups * 16)):
        ours = Mxfp4Weights(packed, scales, gate_up_rows="interleaved" if rows % 2 == 0 else None)
        assert torch.equal(bits(ours.dequantize_reference(dtype).transpose(1, 2)), bits(theirs))


def fp8_checkpoint(experts, rows, columns, block, scale_dtype):
    weight = quant_spec.random_e4m3_bytes((experts, rows, columns))
    grid = (experts, math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    if scale_dtype == FLOAT8_E8M0FNU:
        scale_inv = quant_spec.random_e8m0(grid, 100, 154).view(FLOAT8_E8M0FNU)
    else:
        scale_inv = torch.exp2(torch.empty(grid).uniform_(-30, 30)).to(scale_dtype)
    return weight, scale_inv


@pytest.mark.parametrize("scale_dtype", FP8_SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("experts, rows, columns, block", [(2, 256, 384, (128, 128)), (1, 64, 96, (32, 16))])
def test_fp8_block_matches_transformers_fp8_dequantize(experts, rows, columns, block, scale_dtype):
    """Whole blocks: Fp8Dequantize, the loader's dequantization, in float32."""
    weight, scale_inv = fp8_checkpoint(experts, rows, columns, block, scale_dtype)
    theirs = finegrained_fp8.Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=torch.float32)
    ours = Fp8BlockWeights(weight, scale_inv, block=block).dequantize_reference(torch.float32)
    assert torch.equal(bits(ours), bits(theirs))


@pytest.mark.parametrize("scale_dtype", FP8_SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("experts, rows, columns, block", [
    (2, 130, 200, (128, 128)),  # K = 200: a partial last block column, N = 130: a partial block row
    (1, 7, 13, (4, 8)),
])
def test_fp8_partial_blocks_match_transformers(experts, rows, columns, block, scale_dtype):
    """Partial blocks: the FP8 integration's own dequantization of (..., N, K) weights with per-block
    scales (Fp8Dequantize needs whole blocks)."""
    weight, scale_inv = fp8_checkpoint(experts, rows, columns, block, scale_dtype)
    theirs = finegrained_fp8._dequantize_fp8_weight(weight, scale_inv, list(block), torch.float32)
    ours = Fp8BlockWeights(weight, scale_inv, block=block).dequantize_reference(torch.float32)
    assert torch.equal(bits(ours), bits(theirs))


def test_fp8_experts_tensors_make_stacks():
    """transformers' FP8Experts layout: gate_up_proj (E, 2I, H), gate first, down_proj (E, H, I)."""
    class Config:
        hidden_size, intermediate_size, num_local_experts, hidden_act = 256, 384, 3, "silu"

    experts = finegrained_fp8.FP8Experts(Config(), block_size=(128, 128))
    with torch.no_grad():  # the module allocates its tensors uninitialised: give them valid values
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            weight.copy_(quant_spec.random_e4m3_bytes(weight.shape))
            getattr(experts, f"{name}_scale_inv").uniform_(0.5, 2)
    gate_up = Fp8BlockWeights(experts.gate_up_proj, experts.gate_up_proj_scale_inv, block=experts.block_size,
                              gate_up_rows="concatenated")
    down = Fp8BlockWeights(experts.down_proj, experts.down_proj_scale_inv, block=experts.block_size)
    assert gate_up.shape == (3, 768, 256) and down.shape == (3, 256, 384)
    assert gate_up.gate_and_up_rows() == (slice(0, 384), slice(384, 768))
    theirs = finegrained_fp8._dequantize_fp8_weight(experts.down_proj, experts.down_proj_scale_inv, [128, 128],
                                                    torch.float32)
    assert torch.equal(bits(down.dequantize_reference(torch.float32)), bits(theirs))
