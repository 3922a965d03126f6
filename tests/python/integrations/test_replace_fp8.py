"""replace_moe_blocks on a model whose experts are transformers' FP8 experts (FP8Experts): the moe_layers
it builds hold the experts' block-FP8 codes and scales themselves (quantized_swiglu experts over the
same storage, nothing dequantized), and compute what the blocks computed through tutel's FP8 experts
implementation, within the dtype's tolerance.

The FP8 experts are built as transformers' quantizer builds them on a CPU-only machine would not
(it dequantizes at load time): declared with ``use_experts_implementation(...,
experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)`` and filled with weights quantized by tutel.quant.
"""
import copy

import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers as tutel_hf  # noqa: E402
from tutel.experts.quantized_swiglu import QuantizedSwiGLUExperts  # noqa: E402
from tutel.quant import Fp8BlockWeights  # noqa: E402
from tutel.quant.codes import FLOAT8_E8M0FNU  # noqa: E402

from tiny_transformers_models import VOCAB, build  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def fp8_experts_class():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation
    return use_experts_implementation(experts_class=type("TinyFP8Experts", (FP8Experts,), {}),
                                      experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)


def quantized(weight, block, scale_dtype, apart):
    """(codes, scales) of a float (E, N, K) stack; the two row halves quantized apart where `apart`
    (DeepSeek-V3's separate gate and up projections)."""
    if apart:
        half = weight.shape[1] // 2
        parts = [quantized(part, block, scale_dtype, False) for part in (weight[:, :half], weight[:, half:])]
        return tuple(torch.cat(pieces, dim=1) for pieces in zip(*parts))
    stack = Fp8BlockWeights.quantize(weight, block=block, scale_dtype=scale_dtype)
    return stack.weight, stack.scale_inv


def fp8_model(family, dtype, block, scale_dtype, apart, scheme, seed=0):
    """A tiny random model of `family` in `dtype` whose experts are FP8 experts run by "tutel" with
    the activations `scheme`."""
    model = build(family, dtype=dtype, seed=seed)
    experts_class = fp8_experts_class()
    for name, experts in list(model.named_modules()):
        if not name.endswith(".experts"):
            continue
        with torch.device("meta"):
            fp8 = experts_class(experts.config, block_size=block, activation_scheme="dynamic")
        for tensor_name in ("gate_up_proj", "down_proj"):
            codes, scales = quantized(getattr(experts, tensor_name).detach().double(), block, scale_dtype,
                                      apart and tensor_name == "gate_up_proj")
            setattr(fp8, tensor_name, torch.nn.Parameter(codes))
            setattr(fp8, tensor_name + "_scale_inv",
                    torch.nn.Parameter(scales, requires_grad=scales.is_floating_point()))
        model.set_submodule(name, fp8)
    tutel_hf.enable(model, fp8_activations=scheme)  # "dynamic" (W8A8, the checkpoint's scheme) or "weight_only"
    return model


CASES = [("qwen3_moe", (16, 16), torch.float32, True, "dynamic"),
         ("qwen3_moe", (128, 128), FLOAT8_E8M0FNU or torch.bfloat16, False, "weight_only"),
         ("deepseek_v3", (8, 16), torch.bfloat16, True, "weight_only"),
         ("deepseek_v3", (128, 128), torch.float32, False, "dynamic")]


def blocks_of(model):
    return [(name, module) for name, module in model.named_modules() if name.endswith(".mlp")
            and hasattr(module, "experts")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family, block, scale_dtype, apart, scheme", CASES)
def test_replaced_fp8_blocks_keep_the_codes_and_compute_what_the_blocks_computed(family, block, scale_dtype, apart,
                                                                                 scheme, dtype):
    model = fp8_model(family, dtype, block, scale_dtype, apart, scheme)
    blocks = blocks_of(model)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=generator).to(dtype)
    fp8_tensors, expected = {}, {}
    with torch.no_grad():
        for name, block_module in blocks:
            fp8_tensors[name] = {n: getattr(block_module.experts, n) for n in
                                 ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")}
            expected[name] = block_module(hidden)
        prompt = torch.randint(3, VOCAB, (2, 6), generator=generator)
        logits = model(prompt).logits

    assert tutel_hf.replace_moe_blocks(model) == len(blocks)
    for name, _ in blocks:
        layer = model.get_submodule(name)
        experts = layer.experts
        assert isinstance(experts, QuantizedSwiGLUExperts) and experts.format == "fp8_block"
        assert experts.activations == scheme
        theirs = fp8_tensors[name]
        # the same storage as the FP8 module's codes and scales: nothing dequantized, nothing copied
        for buffer in experts.buffers():
            assert buffer.dtype in (torch.float8_e4m3fn, scale_dtype)
            assert any(buffer.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in theirs.values())
        resident = sum(b.numel() * b.element_size() for b in experts.buffers())
        assert resident == sum(t.numel() * t.element_size() for t in theirs.values()) == experts.packed_bytes()
        assert not any(True for _ in experts.parameters())
        with torch.no_grad():
            actual = layer(hidden)
        assert actual.dtype == dtype and actual.shape == expected[name].shape
        scale = max(1.0, float(expected[name].abs().max()))
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(actual.double(), expected[name].double(), rtol=tolerance, atol=tolerance * scale)
    if dtype == torch.float32:
        with torch.no_grad():
            replaced_logits = model(prompt).logits
        torch.testing.assert_close(replaced_logits, logits, rtol=1e-4, atol=1e-4)


def test_a_replaced_fp8_layer_runs_inference_only_and_saves_its_codes():
    model = fp8_model("qwen3_moe", torch.float32, (16, 16), torch.float32, True, "weight_only")
    tutel_hf.replace_moe_blocks(model)
    name, layer = blocks_of(model)[0]
    state = model.state_dict()
    for buffer_name in layer.experts.packed_names():
        stored = state[f"{name}.experts.{buffer_name}"]
        assert torch.equal(stored.view(torch.uint8), getattr(layer.experts, buffer_name).view(torch.uint8))
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for buffer in fresh.buffers():
            if buffer.dtype == torch.float8_e4m3fn:
                buffer.view(torch.uint8).zero_()
    fresh.load_state_dict(state)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(fresh(prompt).logits, model(prompt).logits)
    with pytest.raises(NotImplementedError, match=r"inference only.*torch\.no_grad\(\)"):
        model(prompt)  # grad mode on: the embeddings require grad, so the experts' inputs do


def test_fp8_experts_of_another_gate_are_refused_naming_the_module_and_nothing_is_replaced():
    model = build("qwen3_moe", dtype=torch.float32, hidden_act="gelu")
    experts_class = fp8_experts_class()
    for name, experts in list(model.named_modules()):
        if name.endswith(".experts"):
            with torch.device("meta"):
                fp8 = experts_class(experts.config, block_size=(16, 16), activation_scheme="dynamic")
            for tensor_name in ("gate_up_proj", "down_proj"):
                codes, scales = quantized(getattr(experts, tensor_name).detach().double(), (16, 16), torch.float32,
                                          False)
                setattr(fp8, tensor_name, torch.nn.Parameter(codes, requires_grad=False))
                setattr(fp8, tensor_name + "_scale_inv", torch.nn.Parameter(scales, requires_grad=False))
            model.set_submodule(name, fp8)
    before = [module for _, module in blocks_of(model)]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp.*FP8 experts.*not SwiGLU"):
        tutel_hf.replace_moe_blocks(model)
    assert [module for _, module in blocks_of(model)] == before
