"""tutel.ops.decode_quantized_experts on a CUDA device launches its two kernels and never waits for
the host.

Traced on fake CUDA tensors (tests/python/launch_count.py): a host synchronisation or a
data-dependent shape raises there, as it would break CUDA-graph capture, and the operators the call
dispatches are counted, weighted by their CUDA launches (csrc/ops/cuda/decode_quantized_experts_cuda.cpp:
gate/up, then down and the sum over k).  The stacks are shaped like the published models' (sizes
cost nothing on fake tensors).  The kernels' results are tested on the CPU, against a long double
loop, by tests/cpp/kernels_on_cpu/quantized_decode_cu_test.cpp.
"""
from typing import NamedTuple, Optional, Tuple

import pytest
import torch

from tutel.ops.decode_quantized_experts import decode_quantized_experts
from tutel.ops.gated_units import SWIGLU, GatedUnit

from launch_count import OperatorCount, fake_cuda

OPERATOR = "tutel.decode_quantized_experts.default"
GPT_OSS = GatedUnit(1.702, 1.0, 7.0, interleaved=True)


class Model(NamedTuple):
    name: str
    format: str
    experts: int
    k: int
    hidden: int
    intermediate: int
    block: Optional[Tuple[int, int]] = None


MODELS = [
    Model("gpt-oss-20b", "mxfp4", 32, 4, 2880, 2880),
    Model("qwen3-30b-a3b-nvfp4", "nvfp4", 128, 8, 2048, 768),
    Model("deepseek-v3", "fp8_block", 256, 8, 7168, 2048, (128, 128)),
]


def _stack(model: Model, rows: int, cols: int, scale_dtype: torch.dtype = torch.float32) -> dict:
    """One stack [E, rows, cols] of the model's format as fake CUDA tensors: codes, scales, global."""
    e = model.experts
    if model.format == "fp8_block":
        b0, b1 = model.block
        return dict(codes=torch.empty(e, rows, cols, dtype=torch.float8_e4m3fn, device="cuda"),
                    scales=torch.rand(e, -(-rows // b0), -(-cols // b1), device="cuda").to(scale_dtype), glob=None)
    codes = torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, device="cuda")
    if model.format == "mxfp4":
        return dict(codes=codes, scales=torch.randint(110, 130, (e, rows, cols // 32), dtype=torch.uint8,
                                                      device="cuda"), glob=None)
    return dict(codes=codes, scales=torch.empty(e, rows, cols // 16, dtype=torch.float8_e4m3fn, device="cuda"),
                glob=torch.rand(e, device="cuda"))


def _call(model: Model, tokens: int, unit, ids_dtype: torch.dtype = torch.int64,
          bias_dtype: Optional[torch.dtype] = None, scale_dtype: torch.dtype = torch.float32):
    """A decode_quantized_experts call on the model's stacks (fake CUDA tensors), as a function."""
    e, h, i = model.experts, model.hidden, model.intermediate
    gated = isinstance(unit, GatedUnit)
    up_rows = 2 * i if gated else i
    gate_up, down = _stack(model, up_rows, h, scale_dtype), _stack(model, h, i, scale_dtype)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, e, (tokens, model.k), device="cuda", dtype=ids_dtype)
    weights = torch.rand(tokens, model.k, device="cuda", dtype=torch.bfloat16)
    biases = {}
    if bias_dtype is not None:
        biases = dict(gate_up_bias=torch.randn(e, up_rows, device="cuda", dtype=bias_dtype),
                      down_bias=torch.randn(e, h, device="cuda", dtype=bias_dtype))

    def call() -> torch.Tensor:
        return decode_quantized_experts(x, ids, weights, model.format, gate_up["codes"], gate_up["scales"],
                                        down["codes"], down["scales"], gate_up_global=gate_up["glob"],
                                        down_global=down["glob"], block=model.block, unit=unit, **biases)
    return call


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("unit", [SWIGLU, GPT_OSS, "gelu"], ids=["swiglu", "gpt-oss", "gelu"])
def test_a_call_is_two_kernels_with_no_host_synchronisation(model, tokens, unit):
    """Any format and unit, int32 or int64 ids, bfloat16 routing weights and float32 biases: the one
    operator, its two kernels, nothing read back to the host (the fake mode would raise)."""
    with fake_cuda(), torch.no_grad():
        call = _call(model, tokens, unit, ids_dtype=torch.int32 if tokens == 1 else torch.int64,
                     bias_dtype=torch.float32 if unit is GPT_OSS else None)
        with OperatorCount() as count:
            out = call()
    assert count.operators == [OPERATOR]
    assert count.kernels == 2
    assert out.shape == (tokens, model.hidden) and out.dtype == torch.bfloat16 and out.device.type == "cuda"


def test_biases_of_another_dtype_cost_one_conversion_each():
    """The kernels read float32 biases; gpt-oss' bfloat16 ones are converted per call (a caller that
    converts them once saves the two launches)."""
    with fake_cuda(), torch.no_grad():
        call = _call(MODELS[0], 4, GPT_OSS, bias_dtype=torch.bfloat16)
        with OperatorCount() as count:
            call()
    assert count.operators == ["aten._to_copy.default", "aten._to_copy.default", OPERATOR]
    assert count.kernels == 4


def test_fp8_block_scales_other_than_float32_are_converted_first():
    with fake_cuda(), torch.no_grad():
        call = _call(MODELS[2], 8, SWIGLU, scale_dtype=torch.bfloat16)
        with OperatorCount() as count:
            call()
    assert count.operators == [OPERATOR]
    assert count.kernels == 4  # a conversion per stack inside the operator, then the two kernels


def test_other_devices_are_refused_by_name():
    model = MODELS[0]
    x = torch.randn(2, model.hidden, device="meta")
    ids = torch.zeros(2, model.k, dtype=torch.int64, device="meta")
    codes = torch.empty(model.experts, 2 * model.intermediate, model.hidden // 2, dtype=torch.uint8, device="meta")
    scales = torch.empty(model.experts, 2 * model.intermediate, model.hidden // 32, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="runs on the CPU and CUDA devices, but `x` is on meta"):
        decode_quantized_experts(x, ids, None, "mxfp4", codes, scales, codes, scales)
