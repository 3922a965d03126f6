"""Quantized experts on a CUDA device launch few kernels and never wait for the host: routed experts
over tutel.quant stacks and moe_layer with quantized SwiGLU experts (packed stacks, or
``layer.quantize_experts``), at 1, 16 and 2048 tokens, in MXFP4, NVFP4 and block FP8.

Traced on fake CUDA tensors (tests/python/launch_count.py): a host synchronisation or a
data-dependent shape raises there, as it would break CUDA-graph capture, and the operators the
call dispatches are counted, weighted by their CUDA launches.  Up to 32 tokens (weight-only) the
decode operator takes the call (two kernels); past it the rows are grouped by expert on the device
and both products run quantized_grouped_linear (one launch each, the group ends an int32 device
tensor).  The counts are exact, so a launch added shows; the budgets are the project's (routed
experts 8 kernels a forward, moe_layer 12 with its routing and loss).  W8A8 ("dynamic")
activations are quantized inside each product's launch (the operator's activation_group), so they
take the weight-only prefill's launches at every size.

The stacks have the published models' shapes: the formats' constructors check their values, so
they are made over stand-ins (one zero element expanded to each tensor's shape) and their format
then put over fake CUDA tensors of the same shapes (sizes cost nothing on fake tensors).  What the
kernels compute is tested on the CPU against float64 references (test_quantized_experts.py,
test_moe_quantized_experts.py) and, on a CUDA device, by the tests marked so there.
"""
from typing import NamedTuple, Optional, Tuple

import pytest
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from tutel import moe
from tutel.experts.quantized import routed_quantized_experts
from tutel.ops.gated_units import SWIGLU, GatedUnit
from tutel.quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights
from tutel.rules.paths import Path

from launch_count import OperatorCount, fake_cuda
from test_launch_budget import EXPERTS_FORWARD_BUDGET, LAYER_FORWARD_BUDGET

GPT_OSS = GatedUnit(1.702, 1.0, 7.0, interleaved=True)
TOKENS = (1, 16, 2048)
DECODE = ["tutel.decode_quantized_experts.default"]
# group_by_expert (2 kernels), the rows, the up product, the unit, the down product, the combine
PREFILL = ["tutel.group_by_expert.default", "tutel.choice_rows.default", "tutel.quantized_grouped_linear.default",
           "tutel.gated_unit.default", "tutel.quantized_grouped_linear.default", "tutel.gather_slots.default"]
PREFILL_KERNELS = 7
# W8A8: the prefill's launches, each product quantizing its input rows inside its kernel
DYNAMIC_KERNELS = PREFILL_KERNELS


class Family(NamedTuple):
    name: str
    format: str
    experts: int
    k: int
    hidden: int
    intermediate: int
    unit: GatedUnit = SWIGLU
    biases: bool = False
    block: Optional[Tuple[int, int]] = None


FAMILIES = [
    Family("gpt-oss-20b", "mxfp4", 32, 4, 2880, 2880, GPT_OSS, True),
    Family("qwen3-30b-a3b-nvfp4", "nvfp4", 128, 8, 2048, 768),
    Family("deepseek-v3", "fp8_block", 256, 8, 7168, 2048, block=(128, 128)),
]


def _stand_in(shape, dtype, value=0.0):
    return torch.full((1,) * len(shape), value, dtype=torch.float32).to(dtype).expand(shape)


def fake_stack(format: str, experts: int, rows: int, columns: int, block=None, gate_up_rows=None):
    """A stack of `format` (E, rows, columns) over fake CUDA tensors (call inside fake_cuda()): the
    format's own checks run on CPU stand-ins of its tensors' shapes, then its format is put over
    fake tensors of those shapes."""
    with unset_fake_temporarily():
        if format == "mxfp4":
            template = Mxfp4Weights(_stand_in((experts, rows, columns // 2), torch.uint8),
                                    _stand_in((experts, rows, columns // 32), torch.uint8, 127),
                                    gate_up_rows=gate_up_rows)
        elif format == "nvfp4":
            template = Nvfp4Weights(_stand_in((experts, rows, columns // 2), torch.uint8),
                                    _stand_in((experts, rows, columns // 16), torch.float8_e4m3fn, 1),
                                    _stand_in((experts,), torch.float32, 1), gate_up_rows=gate_up_rows)
        else:
            grid = (experts, -(-rows // block[0]), -(-columns // block[1]))
            template = Fp8BlockWeights(_stand_in((experts, rows, columns), torch.float8_e4m3fn),
                                       _stand_in(grid, torch.float32, 1), block=block, gate_up_rows=gate_up_rows)
    return template.with_tensors({name: torch.empty(tensor.shape, dtype=tensor.dtype, device="cuda")
                                  for name, tensor in template.tensors().items()})


def _routed_call(family: Family, tokens: int, activations: str = "weight_only", dtype=torch.bfloat16,
                 bias_dtype=torch.float32):
    """A routed_quantized_experts call on the family's stacks (fake CUDA tensors), as a function."""
    e, h, i = family.experts, family.hidden, family.intermediate
    rows = "interleaved" if family.unit.interleaved else "concatenated"
    up = fake_stack(family.format, e, 2 * i, h, family.block, rows)
    down = fake_stack(family.format, e, h, i, family.block)
    x = torch.randn(tokens, h, device="cuda", dtype=dtype)
    ids = torch.randint(0, e, (tokens, family.k), device="cuda")
    weights = torch.rand(tokens, family.k, device="cuda", dtype=dtype)
    biases = {}
    if family.biases:
        biases = dict(up_bias=torch.randn(e, 2 * i, device="cuda", dtype=bias_dtype),
                      down_bias=torch.randn(e, h, device="cuda", dtype=bias_dtype))

    def call() -> torch.Tensor:
        return routed_quantized_experts(x, ids, weights, up, down, gate=family.unit, activations=activations,
                                        **biases)
    return call


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("tokens", TOKENS)
def test_routed_quantized_experts_read_nothing_back_within_the_budget(family, tokens):
    with fake_cuda(), torch.no_grad():
        call = _routed_call(family, tokens)
        with OperatorCount() as count:
            y = call()
    assert y.shape == (tokens, family.hidden) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
    if tokens <= 32:
        assert count.operators == DECODE and count.kernels == 2
    else:
        assert count.operators == PREFILL and count.kernels == PREFILL_KERNELS
    assert count.kernels <= EXPERTS_FORWARD_BUDGET


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_float32_and_float16_tokens_keep_the_grouped_products(dtype):
    """Not the per-expert cuBLAS products of float experts, which read the group ends on the host."""
    with fake_cuda(), torch.no_grad():
        call = _routed_call(FAMILIES[0], 2048, dtype=dtype)
        with OperatorCount() as count:
            y = call()
    assert y.dtype == dtype and count.operators == PREFILL


def test_16_bit_biases_given_per_call_cost_a_conversion_each():
    """routed_quantized_experts converts bfloat16 biases on every call (the modules keep them
    converted: test_quantized_swiglu_keeps_its_16_bit_biases_converted)."""
    with fake_cuda(), torch.no_grad():
        call = _routed_call(FAMILIES[0], 1, bias_dtype=torch.bfloat16)
        with OperatorCount() as count:
            call()
    assert count.operators == ["aten._to_copy.default", "aten._to_copy.default"] + DECODE


@pytest.mark.parametrize("tokens", TOKENS)
def test_w8a8_quantizes_the_activations_on_the_device(tokens):
    """activations="dynamic" (block FP8): the grouped path at every size, nothing read back."""
    family = FAMILIES[2]
    with fake_cuda(), torch.no_grad():
        call = _routed_call(family, tokens, activations="dynamic")
        with OperatorCount() as count:
            y = call()
    assert y.shape == (tokens, family.hidden)
    assert "tutel.decode_quantized_experts.default" not in count.operators
    assert count.operators == PREFILL
    assert count.kernels == DYNAMIC_KERNELS <= EXPERTS_FORWARD_BUDGET


# -- moe_layer -------------------------------------------------------------------------------------


def _fake_layer(layer: torch.nn.Module, mode, dtype: torch.dtype) -> torch.nn.Module:
    """`layer` with its parameters as fake CUDA tensors of `dtype` and its buffers as fake CUDA
    tensors of their own dtype (codes and scales), the biases in `dtype`."""
    for module in layer.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                with unset_fake_temporarily():
                    param = param.detach()
                module._parameters[name] = torch.nn.Parameter(mode.from_tensor(param).to("cuda", dtype),
                                                              requires_grad=False)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                with unset_fake_temporarily():
                    buffer = buffer.detach()
                fake = mode.from_tensor(buffer).to("cuda")
                module._buffers[name] = fake.to(dtype) if name.endswith("bias") else fake
    return layer


def _packed_layer(family: Family, mode, dtype=torch.bfloat16):
    """moe_layer over the family's quantized SwiGLU experts (packed stacks; bfloat16 biases, as a
    layer converted to bfloat16 holds them), dropless, in eval mode."""
    e, h, i = family.experts, family.hidden, family.intermediate
    rows = "interleaved" if family.unit.interleaved else "concatenated"
    stacks = dict(up=fake_stack(family.format, e, 2 * i, h, family.block, rows),
                  down=fake_stack(family.format, e, h, i, family.block))
    if family.biases:
        stacks.update(up_bias=torch.randn(e, 2 * i, device="cuda", dtype=dtype),
                      down_bias=torch.randn(e, h, device="cuda", dtype=dtype))
    with torch.device("meta"):
        gate = {"type": "top", "k": family.k, "capacity_factor": 0.0}
        layer = moe.moe_layer(gate_type=gate, model_dim=h, experts={"type": "quantized_swiglu",
                              "num_experts_per_device": e, "unit": family.unit, **stacks})
    for name, param in list(layer.named_parameters()):  # the gate's weights (the experts hold buffers)
        layer.get_submodule(name.rsplit(".", 1)[0])._parameters[name.rsplit(".", 1)[1]] = torch.nn.Parameter(
            torch.empty(param.shape, device="cuda", dtype=dtype), requires_grad=False)
    return layer.eval()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("tokens", TOKENS)
def test_moe_layer_over_packed_stacks_reads_nothing_back_within_the_budget(family, tokens):
    """The gate's product, route_experts (two kernels), the grouped rows, both products, the unit
    and the combine: the static grouped path at every size."""
    with fake_cuda() as mode, torch.no_grad():
        layer = _packed_layer(family, mode)
        x = torch.randn(tokens, family.hidden, device="cuda", dtype=torch.bfloat16)
        assert layer.choose_path(x).path is Path.STATIC_GROUPED
        layer(x)  # (the biases' float32 copies made once)
        with OperatorCount() as count:
            y = layer(x)
    assert y.shape == (tokens, family.hidden) and y.device.type == "cuda"
    assert count.operators == ["aten.mm.default", "tutel.route_experts.default", "tutel.scatter_slots.default",
                               "tutel.quantized_grouped_linear.default", "tutel.gated_unit.default",
                               "tutel.quantized_grouped_linear.default", "tutel.gather_slots.default"]
    assert count.kernels == 9 <= LAYER_FORWARD_BUDGET


def test_quantized_swiglu_keeps_its_16_bit_biases_converted():
    """bfloat16 biases (a layer converted to bfloat16) are widened once, then reused while unchanged;
    a bias changed in place is widened again."""
    family = FAMILIES[0]
    with fake_cuda() as mode, torch.no_grad():
        layer = _packed_layer(family, mode)
        x = torch.randn(2048, family.hidden, device="cuda", dtype=torch.bfloat16)
        with OperatorCount() as first:
            layer(x)
        with OperatorCount() as second:
            layer(x)
        layer.experts.up_bias.add_(1)
        with OperatorCount() as changed:
            layer(x)
    assert first.operators.count("aten._to_copy.default") == 2
    assert "aten._to_copy.default" not in second.operators
    assert changed.operators.count("aten._to_copy.default") == 1


QUANTIZE_CASES = [("mxfp4", {}), ("nvfp4", {}), ("fp8_block", dict(block=(128, 128))),
                  ("fp8_block", dict(block=(128, 128), activations="dynamic"))]


@pytest.mark.parametrize("format, options", QUANTIZE_CASES, ids=["mxfp4", "nvfp4", "fp8_block", "fp8_block-w8a8"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_moe_layer_after_quantize_experts_reads_nothing_back(format, options, tokens):
    """llama_ffn experts quantized in place (their gates a stack apart: three products, the fused
    unit over the gate and up products where they are), made fake CUDA tensors."""
    torch.manual_seed(0)
    layer = moe.moe_layer(gate_type={"type": "top", "k": 4, "capacity_factor": 0.0}, model_dim=256,
                          experts={"type": "llama_ffn", "num_experts_per_device": 16, "hidden_size_per_expert": 128})
    layer.eval().quantize_experts(format, **options)
    with fake_cuda() as mode, torch.no_grad():
        layer = _fake_layer(layer, mode, torch.bfloat16)
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        assert layer.choose_path(x).path is Path.STATIC_GROUPED
        with OperatorCount() as count:
            y = layer(x)
    assert y.shape == (tokens, 256)
    assert count.operators.count("tutel.quantized_grouped_linear.default") == 3
    assert "tutel.gated_unit_pair.default" in count.operators and "aten.cat.default" not in count.operators
    assert count.kernels == 10 <= LAYER_FORWARD_BUDGET, count.operators


def test_a_static_capacity_in_float32_makes_the_slots_ends_on_the_device(monkeypatch):
    """A float32 layer with a capacity takes Tutel's [E, C, M] slots through the module: its ends
    are made on the device (no copy from the host during a capture)."""
    torch.manual_seed(0)
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2, "capacity_factor": 1.0}, model_dim=64,
                          experts={"type": "llama_ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 32})
    layer.eval().quantize_experts("mxfp4")
    with fake_cuda() as mode, torch.no_grad():
        layer = _fake_layer(layer, mode, torch.float32)
        x = torch.randn(16, 64, device="cuda")
        assert layer.choose_path(x).path is Path.STATIC_SLOTS
        with OperatorCount() as count:
            layer(x)
    assert "aten.arange.start_step" in count.operators
    assert count.operators.count("tutel.quantized_grouped_linear.default") == 3
