"""tutel::quantized_grouped_linear on a CUDA device is one kernel launch with int32 ends and never
waits for the host.

Traced on fake CUDA tensors (tests/python/launch_count.py): a host synchronisation or a
data-dependent shape raises there, as it would break CUDA-graph capture, and the operators the call
dispatches are counted, weighted by their CUDA launches (csrc/ops/cuda/quantized_grouped_linear_cuda.cpp:
the kernel, after one conversion per argument it cannot read as given).  The stacks are shaped like
the published models' (sizes cost nothing on fake tensors).  The kernel's results are tested on the
CPU, against a long double loop, by tests/cpp/kernels_on_cpu/quantized_grouped_linear_cu_test.cpp.
"""
from typing import NamedTuple, Optional, Tuple

import pytest
import torch

from launch_count import OperatorCount, fake_cuda

OPERATOR = "tutel.quantized_grouped_linear.default"


class Model(NamedTuple):
    name: str
    format: str
    experts: int
    outputs: int
    features: int
    block: Optional[Tuple[int, int]] = None


MODELS = [
    Model("gpt-oss-20b", "mxfp4", 32, 5760, 2880),
    Model("qwen3-30b-a3b-nvfp4", "nvfp4", 128, 1536, 2048),
    Model("deepseek-v3", "fp8_block", 256, 4096, 7168, (128, 128)),
]


def _call(model: Model, rows: int, ends_dtype: torch.dtype, bias_dtype: Optional[torch.dtype] = None,
          scale_dtype: torch.dtype = torch.float32):
    """A quantized_grouped_linear call on the model's stack (fake CUDA tensors), as a function."""
    e, n, k = model.experts, model.outputs, model.features
    if model.format == "fp8_block":
        codes = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device="cuda")
        scales = torch.rand(e, -(-n // model.block[0]), -(-k // model.block[1]), device="cuda").to(scale_dtype)
        global_scale, block = None, list(model.block)
    else:
        codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
        width = 32 if model.format == "mxfp4" else 16
        scales = torch.randint(110, 130, (e, n, k // width), dtype=torch.uint8, device="cuda")
        if model.format == "nvfp4":
            scales = scales.view(torch.float8_e4m3fn)
        global_scale = torch.rand(e, device="cuda") if model.format == "nvfp4" else None
        block = []
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ends = torch.sort(torch.randint(0, rows + 1, (e,), device="cuda")).values.to(ends_dtype)
    bias = torch.randn(e, n, device="cuda", dtype=bias_dtype) if bias_dtype is not None else None

    def call() -> torch.Tensor:
        return torch.ops.tutel.quantized_grouped_linear(x, ends, model.format, codes, scales, global_scale, block,
                                                        bias)
    return call


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("rows", [1, 4096])
def test_a_call_with_int32_ends_is_one_kernel_with_no_host_synchronisation(model, rows):
    """Any format, a float32 bias or none: the one operator, its one kernel, nothing read back to the
    host (the fake mode would raise)."""
    with fake_cuda(), torch.no_grad():
        call = _call(model, rows, torch.int32, bias_dtype=torch.float32 if rows == 1 else None)
        with OperatorCount() as count:
            out = call()
    assert count.operators == [OPERATOR]
    assert count.kernels == 1
    assert out.shape == (rows, model.outputs) and out.dtype == torch.bfloat16 and out.device.type == "cuda"


def test_int64_ends_a_bfloat16_bias_and_bfloat16_fp8_scales_cost_one_conversion_each():
    with fake_cuda(), torch.no_grad():
        call = _call(MODELS[2], 64, torch.int64, bias_dtype=torch.bfloat16, scale_dtype=torch.bfloat16)
        with OperatorCount() as count:
            call()
    assert count.operators == [OPERATOR]
    assert count.kernels == 4
