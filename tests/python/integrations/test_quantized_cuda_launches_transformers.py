"""transformers' quantized experts through tutel on a CUDA device, traced on fake CUDA tensors
(tests/python/launch_count.py): FP8 experts (``FP8Experts`` with experts_implementation="tutel",
weight-only and W8A8) and gpt-oss' MXFP4 experts (``use_mxfp4_experts``), at 1, 16 and 2048 tokens.
Nothing is read back to the host (the fake mode raises where a value would be), "tutel" is found in
the FP8 experts' own registry (no KeyError), and the launches are counted exactly, within the
routed experts' budget (W8A8 quantizes inside the products' kernels where the block's width is a
multiple of 16; other widths quantize with elementwise operators first, past the budget).  The
values are tested on the CPU (test_transformers_fp8_experts.py,
test_gpt_oss_mxfp4.py) and on a CUDA device by their tests marked so."""
import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers as tutel_hf  # noqa: E402

from launch_count import OperatorCount, fake_cuda, fake_parameters  # noqa: E402
from test_launch_budget import EXPERTS_FORWARD_BUDGET  # noqa: E402
from test_quantized_cuda_launches import DECODE, PREFILL, PREFILL_KERNELS  # noqa: E402

TOKENS = (1, 16, 2048)
# gates and ups a stack each (DeepSeek-V3's checkpoints quantize them apart): three products, the
# fused unit over the gate and up products where they are
APART = ["tutel.group_by_expert.default", "tutel.choice_rows.default", "tutel.quantized_grouped_linear.default",
         "tutel.quantized_grouped_linear.default", "tutel.gated_unit_pair.default",
         "tutel.quantized_grouped_linear.default", "tutel.gather_slots.default"]


def _fp8_experts(family: str, block, scheme: str):
    """The first FP8 experts of a tiny model of `family` (tests/python/integrations'
    fp8_model: its experts quantized by tutel.quant) run by "tutel" with `scheme` activations."""
    from test_transformers_fp8_experts import fp8_model
    model, _ = fp8_model(family, block, torch.float32)
    tutel_hf.enable(model)
    experts = next(module for name, module in model.named_modules() if name.endswith(".experts"))
    experts.tutel_fp8_activations = scheme
    return experts


def _trace(experts, tokens: int, k: int, mode):
    """(the counted second call, its output): the module's tensors made fake CUDA ones, then called
    twice (the first reads its layout over the new tensors, once per state of the module)."""
    fake_parameters(experts, mode)
    hidden = experts.down_proj.shape[1] if hasattr(experts, "down_proj") else experts.hidden_size
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, experts.num_experts, (tokens, k), device="cuda")
    weights = torch.rand(tokens, k, device="cuda", dtype=torch.bfloat16)
    experts(x, ids, weights)
    with OperatorCount() as count:
        y = experts(x, ids, weights)
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.device.type == "cuda"
    return count


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_fp8_experts_with_gate_and_up_fused_read_nothing_back(family, tokens):
    """Blocks that tile the intermediate size: one [gate; up] stack, the decode operator up to 32 tokens."""
    experts = _fp8_experts(family, (5, 8), "weight_only")
    assert experts.gate_up_proj.shape[1] == 20  # I = 10: blocks of 5 rows give gate and up one grid
    with fake_cuda() as mode, torch.no_grad():
        count = _trace(experts, tokens, 2, mode)
    if tokens <= 32:
        assert count.operators == DECODE and count.kernels == 2
    else:
        assert count.operators == PREFILL and count.kernels == PREFILL_KERNELS


@pytest.mark.parametrize("tokens", TOKENS)
def test_fp8_experts_with_gate_and_up_apart_read_nothing_back(tokens):
    """128 x 128 blocks over I = 10: gate and up quantized apart, the grouped products at every size."""
    experts = _fp8_experts("deepseek_v3", (128, 128), "weight_only")
    with fake_cuda() as mode, torch.no_grad():
        count = _trace(experts, tokens, 2, mode)
    assert count.operators == APART and count.kernels == 8 <= EXPERTS_FORWARD_BUDGET


@pytest.mark.parametrize("tokens", TOKENS)
def test_fp8_experts_w8a8_quantize_the_activations_on_the_device(tokens):
    """activation_scheme="dynamic" (FP8Experts' default) with blocks 8 wide, which the operator's
    activation_group does not take: each product's input quantized per token and block of columns
    by elementwise operators first; no host read."""
    experts = _fp8_experts("qwen3_moe", (5, 8), "dynamic")
    with fake_cuda() as mode, torch.no_grad():
        count = _trace(experts, tokens, 2, mode)
    assert count.operators[:2] == PREFILL[:2] and count.operators[-1] == PREFILL[-1]
    assert count.operators.count("tutel.quantized_grouped_linear.default") == 2
    # H = 24 in groups of 8 (bfloat16 widened: 8 launches), I = 10 in groups of 8 (padded with zeros,
    # copied in widened: 9), and each product's float32 result rounded to bfloat16
    assert count.kernels == PREFILL_KERNELS + 8 + 9 + 2, count.operators


@pytest.mark.parametrize("tokens", TOKENS)
def test_fp8_experts_w8a8_with_128_wide_blocks_quantize_inside_the_products(tokens):
    """DeepSeek-V3's activation_scheme="dynamic" over 128 x 128 blocks: quantized_grouped_linear
    quantizes each product's input inside its launch (activation_group 128), so W8A8 takes the
    weight-only launches (gate and up apart: three products)."""
    experts = _fp8_experts("deepseek_v3", (128, 128), "dynamic")
    with fake_cuda() as mode, torch.no_grad():
        count = _trace(experts, tokens, 2, mode)
    assert count.operators == APART and count.kernels == 8 <= EXPERTS_FORWARD_BUDGET


def _gpt_oss_experts():
    from test_gpt_oss_mxfp4 import tiny_model
    model = tutel_hf.use_mxfp4_experts(tiny_model(torch.bfloat16), quantize=True)
    return model.model.layers[0].mlp.experts


@pytest.mark.parametrize("tokens", TOKENS)
def test_gpt_oss_mxfp4_experts_read_nothing_back(tokens):
    experts = _gpt_oss_experts()
    with fake_cuda() as mode, torch.no_grad():
        count = _trace(experts, tokens, 4, mode)
    if tokens <= 32:
        assert count.operators == DECODE and count.kernels == 2
    else:
        assert count.operators == PREFILL and count.kernels == PREFILL_KERNELS


def test_gpt_oss_biases_converted_to_bfloat16_are_widened_once():
    """A model converted to bfloat16 after use_mxfp4_experts holds bfloat16 biases: the module keeps
    their float32 copies (not in its state_dict), so a decoding step is still the two kernels."""
    experts = _gpt_oss_experts().to(torch.bfloat16)
    assert experts.gate_up_proj_bias.dtype == torch.bfloat16 and experts.gate_up_proj_blocks.dtype == torch.uint8
    names = sorted(experts.state_dict())
    with fake_cuda() as mode, torch.no_grad():
        count = _trace(experts, 1, 4, mode)
    assert count.operators == DECODE
    assert sorted(experts.state_dict()) == names
