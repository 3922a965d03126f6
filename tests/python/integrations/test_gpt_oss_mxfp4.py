"""use_mxfp4_experts: tiny gpt-oss models (built from GptOssConfig, every parameter random) whose
experts come from an MXFP4 checkpoint made here in gpt-oss' layout (``*_blocks`` (E, N, K / 32, 16),
``*_scales`` (E, N, K / 32), float32 ``*_bias``).  transformers' own eager experts on the same
checkpoint dequantized by transformers' ``convert_moe_packed_tensors`` are the model reference; a
float64 loop written here from gpt-oss' definition is the experts' reference.  Also: the state
dict round trip, the resident bytes, the weights of a model transformers loaded quantized
(``Mxfp4GptOssExperts``, its Triton tensors imitated here), ``quantize=True`` and bad input."""
import copy
import gc
import io
import math
import os
import types
import weakref

import pytest
import torch

import quant_spec
from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

if os.environ.get("CI") == "true":
    import transformers  # noqa: F401  (CI installs transformers: missing is an error)
pytest.importorskip("transformers")
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402
from transformers.integrations import mxfp4 as hf_mxfp4  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssMLP  # noqa: E402

from tutel.integrations.transformers import TutelGptOssMxfp4Experts, use_mxfp4_experts  # noqa: E402
from tutel.quant import Mxfp4Weights  # noqa: E402

H, I, E, K, LAYERS, VOCAB = 64, 64, 6, 4, 2, 97
ALPHA, LIMIT = 1.702, 7.0
PROJECTIONS = {"gate_up_proj": (2 * I, H), "down_proj": (H, I)}  # (N, K) of each expert's matrix
DTYPES = [torch.float32, torch.bfloat16]
# relative to the largest reference value: each dtype's rounding of the activations (float32: the
# products' float32 accumulation)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}



def assert_close_to(actual, expected, dtype):
    """Within the dtype's tolerance of the largest reference value, elementwise."""
    tolerance = TOLERANCE[dtype]
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tolerance, atol=tolerance * scale)


def bits(tensor):
    """The tensor's bytes as integers: equal bits, zero signs included."""
    return tensor.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[
        tensor.element_size()])


def tiny_config():
    return GptOssConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=E,
                        num_experts_per_tok=K, sliding_window=8, max_position_embeddings=64, swiglu_limit=LIMIT,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0), pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def tiny_model(dtype, seed=0):
    """A tiny gpt-oss causal LM in `dtype`, every parameter ~ N(0, 0.3^2) (transformers zeroes the
    experts' biases), in eval mode."""
    model = GptOssForCausalLM(tiny_config()).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * 0.3)
    return model.eval()


def checkpoint(dtype, seed=1, prefix="model."):
    """gpt-oss' expert tensors of every layer, by their checkpoint names: random float experts
    packed by tutel.quant in gpt-oss' layout, random float32 biases (values `dtype` holds, so that
    transformers' eager experts in `dtype` take them exactly)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        name = f"{prefix}layers.{layer}.mlp.experts."
        for proj, (rows, columns) in PROJECTIONS.items():
            weight = torch.randn(E, rows, columns, generator=generator, dtype=torch.float64) * 0.3
            stack = Mxfp4Weights.quantize(weight, gate_up_rows="interleaved" if proj == "gate_up_proj" else None)
            tensors[name + proj + "_blocks"] = stack.gpt_oss_blocks().clone()
            tensors[name + proj + "_scales"] = stack.scales.clone()
            bias = torch.randn(E, rows, generator=generator, dtype=torch.float64) * 0.3
            tensors[name + proj + "_bias"] = bias.to(dtype).to(torch.float32)
    return tensors


def load_dequantized(model, tensors):
    """transformers' eager experts of `model` set to the checkpoint as transformers' loader
    dequantizes it (convert_moe_packed_tensors: (E, K, N), the x @ W layout of GptOssExperts)."""
    with torch.no_grad():
        for layer, decoder in enumerate(model.model.layers):
            experts = decoder.mlp.experts
            name = f"model.layers.{layer}.mlp.experts."
            for proj in PROJECTIONS:
                dense = hf_mxfp4.convert_moe_packed_tensors(tensors[name + proj + "_blocks"],
                                                            tensors[name + proj + "_scales"], dtype=model.dtype)
                assert dense.shape == getattr(experts, proj).shape
                getattr(experts, proj).copy_(dense)
                getattr(experts, proj + "_bias").copy_(tensors[name + proj + "_bias"])
    return model


def model_pair(dtype):
    """(transformers' eager model on the dequantized checkpoint, its copy with tutel's MXFP4 experts,
    the checkpoint's tensors)."""
    tensors = checkpoint(dtype)
    eager = load_dequantized(tiny_model(dtype), tensors)
    return eager, use_mxfp4_experts(copy.deepcopy(eager), tensors), tensors


def prompts(seed=2, batch=2, length=6):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def expected_bytes(experts=E):
    """What the packed experts of one layer weigh: half a byte per element, a byte per 32, float32 biases."""
    total = 0
    for rows, columns in PROJECTIONS.values():
        total += experts * rows * columns // 2 + experts * rows * columns // 32 + experts * rows * 4
    return total


def resident_bytes(module):
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


# -- the checkpoint's bytes ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_transformers_dequantizes_the_checkpoint_as_tutel_quant_does(dtype):
    tensors = checkpoint(torch.float32)
    for layer in range(LAYERS):
        for proj, (rows, columns) in PROJECTIONS.items():
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks, scales = tensors[name + "_blocks"], tensors[name + "_scales"]
            assert blocks.shape == (E, rows, columns // 32, 16) and scales.shape == (E, rows, columns // 32)
            theirs = hf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, K, N)
            ours = Mxfp4Weights(blocks, scales).dequantize_reference(dtype).transpose(1, 2)
            assert torch.equal(bits(ours), bits(theirs)), name
            # and both are the specification's values (decoded here, element by element)
            spec = quant_spec.decode_mxfp4(blocks.reshape(E, rows, -1), scales).to(dtype).transpose(1, 2)
            assert torch.equal(bits(spec), bits(theirs)), name


# -- the experts against a float64 reference ----------------------------------------------------


def reference_experts(x, ids, weights, tensors, prefix, dtype):
    """gpt-oss' experts in float64, choice by choice, from the spec's decoded weights; the hidden
    activations rounded to `dtype` where tutel hands them from one product to the next."""
    gate_up = quant_spec.decode_mxfp4(tensors[prefix + "gate_up_proj_blocks"].reshape(E, 2 * I, -1),
                                      tensors[prefix + "gate_up_proj_scales"])
    down = quant_spec.decode_mxfp4(tensors[prefix + "down_proj_blocks"].reshape(E, H, -1),
                                   tensors[prefix + "down_proj_scales"])
    gate_up_bias = tensors[prefix + "gate_up_proj_bias"].double()
    down_bias = tensors[prefix + "down_proj_bias"].double()
    x, weights = x.double(), weights.double()
    y = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            projected = gate_up[e] @ x[t] + gate_up_bias[e]
            gate, up = projected[0::2].clamp(max=LIMIT), projected[1::2].clamp(-LIMIT, LIMIT)
            hidden = ((up + 1) * gate * torch.sigmoid(ALPHA * gate)).to(dtype).double()
            y[t] += weights[t, j] * (down[e] @ hidden + down_bias[e])
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [0, 1, 7])
def test_experts_module_matches_a_float64_reference(dtype, tokens):
    tensors = checkpoint(dtype)
    prefix = "model.layers.1.mlp.experts."
    module = TutelGptOssMxfp4Experts(**{part: tensors[prefix + part] for part in (
        "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks", "down_proj_scales",
        "down_proj_bias")})
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(tokens, H, generator=generator, dtype=torch.float64) * 2).to(dtype)
    ids = torch.rand(tokens, E, generator=generator).argsort(dim=1)[:, :K]
    if tokens > 1:
        ids[0, 0] = E  # an id outside [0, E) (another process' expert) contributes nothing
    weights = torch.rand(tokens, K, generator=generator, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        y = module(x, ids, weights)
    assert y.dtype == dtype and y.shape == (tokens, H)
    expected = reference_experts(x, ids, weights, tensors, prefix, dtype)
    assert_close_to(y, expected, dtype)


# -- the model against transformers' eager experts ----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_generation_matches_transformers_eager_experts(dtype):
    eager, ours, _ = model_pair(dtype)
    for decoder in ours.model.layers:
        assert isinstance(decoder.mlp.experts, TutelGptOssMxfp4Experts)
    ids = prompts()
    assert_close_to(logits(ours, ids), logits(eager, ids), dtype)
    with torch.no_grad():
        settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        expected = eager.generate(ids, **settings)
        got = ours.generate(ids, **settings)
    assert torch.equal(got, expected)


def test_conversion_frees_the_float_experts_and_keeps_the_rest():
    eager, _, tensors = model_pair(torch.float32)
    model = copy.deepcopy(eager)
    old = [weakref.ref(decoder.mlp.experts) for decoder in model.model.layers]
    routers = [decoder.mlp.router for decoder in model.model.layers]
    others = {name: p.detach().clone() for name, p in model.named_parameters() if ".experts." not in name}
    use_mxfp4_experts(model, tensors)
    gc.collect()
    assert all(reference() is None for reference in old)
    assert [decoder.mlp.router for decoder in model.model.layers] == routers
    assert not [name for name, _ in model.named_parameters() if ".experts." in name]
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, others[name]), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_resident_bytes_are_packed_scales_and_biases(dtype):
    _, ours, _ = model_pair(dtype)
    for decoder in ours.model.layers:
        experts = decoder.mlp.experts
        assert not list(experts.parameters())
        assert resident_bytes(experts) == expected_bytes()
    float_experts = sum(E * rows * columns + E * rows for rows, columns in PROJECTIONS.values())
    assert expected_bytes() < float_experts * 2 / 3  # under a third of bfloat16's bytes


# -- the state dict -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_state_dict_holds_the_checkpoint_and_round_trips(dtype):
    eager, ours, tensors = model_pair(dtype)
    state = ours.state_dict()
    for name, tensor in tensors.items():  # the checkpoint's own names, bytes and float32 biases
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    # a fresh model converted from other weights (quantized again), then loaded
    fresh = use_mxfp4_experts(tiny_model(dtype, seed=5), quantize=True)
    ids = prompts(seed=4)
    assert not torch.equal(logits(fresh, ids), logits(ours, ids))
    fresh.load_state_dict(loaded)
    assert torch.equal(logits(fresh, ids), logits(ours, ids))
    # and the state dict is what use_mxfp4_experts takes
    again = use_mxfp4_experts(copy.deepcopy(eager), loaded)
    assert torch.equal(logits(again, ids), logits(ours, ids))


def test_loading_a_nan_scale_is_refused():
    _, ours, _ = model_pair(torch.float32)
    state = {name: tensor.clone() for name, tensor in ours.state_dict().items()}
    state["model.layers.1.mlp.experts.down_proj_scales"][2, 5, 1] = 255
    key = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    before = ours.state_dict()[key].clone()
    state[key] = torch.zeros_like(before)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales.*255"):
        ours.load_state_dict(state)
    # nothing of that module was copied
    assert torch.equal(ours.state_dict()[key], before)
    assert not bool((ours.model.layers[1].mlp.experts.down_proj_scales == 255).any())


# -- where the packed weights come from ---------------------------------------------------------


def test_quantize_true_gives_the_checkpoint_values_back_from_its_dequantized_weights():
    """Weights dequantized from MXFP4 (held exactly in bfloat16) quantize to the same values."""
    eager, ours, _ = model_pair(torch.bfloat16)
    again = use_mxfp4_experts(copy.deepcopy(eager), quantize=True)
    for decoder, theirs in zip(again.model.layers, ours.model.layers):
        for stack, other in zip(decoder.mlp.experts.stacks(), theirs.mlp.experts.stacks()):
            assert torch.equal(stack.dequantize_reference(), other.dequantize_reference())
    ids = prompts(seed=6)
    assert torch.equal(logits(again, ids), logits(ours, ids))


class SwizzledLayout:
    """Stands in for the Triton kernels' layout: its data lies reversed along the rows."""

    @staticmethod
    def swizzle(tensor):
        return tensor.flip(-1).contiguous()

    @staticmethod
    def unswizzle_data(data):
        return data.flip(-1)


def triton_tensor(tensor):
    """An object with the storage a triton_kernels tensor offers (``storage.data``, ``storage.layout``)."""
    layout = SwizzledLayout()
    return types.SimpleNamespace(storage=types.SimpleNamespace(data=layout.swizzle(tensor), layout=layout),
                                 shape=tensor.shape)


def loaded_quantized(model, tensors):
    """`model` as transformers loads an MXFP4 checkpoint on a GPU: each GptOssMLP replaced by an
    Mxfp4GptOssMLP whose Mxfp4GptOssExperts hold the blocks and scales as swizzle_mxfp4_convertops
    leaves them (the transposed bytes in the kernels' layout) and the float32 biases."""
    for layer, decoder in enumerate(model.model.layers):
        experts = hf_mxfp4.Mxfp4GptOssExperts(model.config)
        name = f"model.layers.{layer}.mlp.experts."
        for proj in PROJECTIONS:
            blocks, scales = tensors[name + proj + "_blocks"], tensors[name + proj + "_scales"]
            del experts._parameters[proj]
            setattr(experts, proj, triton_tensor(blocks.reshape(E, blocks.shape[1], -1).transpose(-2, -1)))
            setattr(experts, proj + "_precision_config",
                    types.SimpleNamespace(weight_scale=triton_tensor(scales.transpose(-2, -1))))
            with torch.no_grad():
                getattr(experts, proj + "_bias").copy_(tensors[name + proj + "_bias"])
        decoder.mlp = hf_mxfp4.Mxfp4GptOssMLP(decoder.mlp.router, experts)
    return model


def test_weights_of_a_model_loaded_quantized():
    eager, ours, tensors = model_pair(torch.float32)
    model = loaded_quantized(copy.deepcopy(eager), tensors)
    # transformers' own reading of these modules (what it saves) is the checkpoint
    reverse = getattr(hf_mxfp4, "Mxfp4ReverseDeserialize", None)
    if reverse is not None:
        for layer in range(LAYERS):
            for proj in PROJECTIONS:
                name = f"model.layers.{layer}.mlp.experts.{proj}"
                saved = reverse(None).convert({}, model=model, full_layer_name=name + "_blocks")
                assert torch.equal(saved[name + "_blocks"], tensors[name + "_blocks"])
                assert torch.equal(saved[name + "_scales"], tensors[name + "_scales"])
    routers = [decoder.mlp.router for decoder in model.model.layers]
    use_mxfp4_experts(model)
    for decoder, router in zip(model.model.layers, routers):
        assert type(decoder.mlp) is GptOssMLP and decoder.mlp.router is router
        assert isinstance(decoder.mlp.experts, TutelGptOssMxfp4Experts)
    state = model.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name
    ids = prompts(seed=7)
    assert torch.equal(logits(model, ids), logits(ours, ids))


def test_a_bare_gpt_oss_model_takes_the_causal_lm_names():
    eager, ours, tensors = model_pair(torch.float32)
    body = use_mxfp4_experts(copy.deepcopy(eager.model), tensors)
    ids = prompts(seed=8)
    with torch.no_grad():
        assert torch.equal(body(ids).last_hidden_state, ours.model(ids).last_hidden_state)


def test_a_converted_model_is_left_as_it_is_and_takes_new_tensors():
    _, ours, _ = model_pair(torch.float32)
    first = [decoder.mlp.experts for decoder in ours.model.layers]
    use_mxfp4_experts(ours)
    assert [decoder.mlp.experts for decoder in ours.model.layers] == first
    other = checkpoint(torch.float32, seed=9)
    use_mxfp4_experts(ours, other)
    assert torch.equal(ours.state_dict()["model.layers.0.mlp.experts.down_proj_blocks"],
                       other["model.layers.0.mlp.experts.down_proj_blocks"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_converted_model_computes_what_it_computes_on_the_cpu():
    """The CUDA path's launches are counted on fake CUDA tensors (test_quantized_cuda_launches_transformers.py)."""
    eager, ours, tensors = model_pair(torch.float32)
    model = use_mxfp4_experts(copy.deepcopy(eager).cuda(), tensors)
    experts = model.model.layers[0].mlp.experts
    assert all(t.device.type == "cuda" for t in experts.buffers())
    ids = prompts()
    on_cuda, on_cpu = logits(model, ids.cuda()).cpu().double(), logits(ours, ids).double()
    # float32 both, summed in other orders by the two devices' kernels (attention's included)
    torch.testing.assert_close(on_cuda, on_cpu, rtol=1e-4, atol=1e-4 * float(on_cpu.abs().max()))


# -- bad input ----------------------------------------------------------------------------------


def test_float_experts_without_tensors_say_what_to_pass():
    model = tiny_model(torch.float32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts \(GptOssExperts\) holds float weights.*"
                                         r"expert_tensors=.*quantize=True"):
        use_mxfp4_experts(model)
    assert all(type(decoder.mlp.experts) is GptOssExperts for decoder in model.model.layers)


def test_a_model_without_gpt_oss_experts():
    with pytest.raises(ValueError, match="Linear has no gpt-oss experts"):
        use_mxfp4_experts(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="`model` must be a torch.nn.Module"):
        use_mxfp4_experts("openai/gpt-oss-20b")


def test_arguments_of_the_wrong_kind():
    model = tiny_model(torch.float32)
    with pytest.raises(TypeError, match="`expert_tensors` must be a mapping"):
        use_mxfp4_experts(model, list(checkpoint(torch.float32).values()))
    with pytest.raises(TypeError, match="`quantize` must be a bool, got str"):
        use_mxfp4_experts(model, quantize="yes")


def test_a_missing_tensor_is_named_and_nothing_is_replaced():
    model = tiny_model(torch.float32)
    tensors = checkpoint(torch.float32)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    with pytest.raises(ValueError, match=r"no 'model\.layers\.1\.mlp\.experts\.down_proj_scales'"):
        use_mxfp4_experts(model, tensors)
    assert all(type(decoder.mlp.experts) is GptOssExperts for decoder in model.model.layers)


@pytest.mark.parametrize("part, shape", [
    ("gate_up_proj_blocks", (E, 2 * I, H // 32, 8)),
    ("gate_up_proj_scales", (E, I, H // 32)),
    ("gate_up_proj_bias", (E, H)),
    ("down_proj_blocks", (E - 1, H, I // 32, 16)),
    ("down_proj_scales", (E, H, I // 16)),
    ("down_proj_bias", (E, 2 * I)),
])
def test_a_tensor_of_the_wrong_shape_is_named_with_the_shape_expected(part, shape):
    tensors = checkpoint(torch.float32)
    name = f"model.layers.0.mlp.experts.{part}"
    tensors[name] = torch.zeros(shape, dtype=tensors[name].dtype)
    expected = {"gate_up_proj_blocks": (E, 2 * I, H // 32, 16), "gate_up_proj_scales": (E, 2 * I, H // 32),
                "gate_up_proj_bias": (E, 2 * I), "down_proj_blocks": (E, H, I // 32, 16),
                "down_proj_scales": (E, H, I // 32), "down_proj_bias": (E, H)}[part]
    with pytest.raises(ValueError) as error:
        use_mxfp4_experts(tiny_model(torch.float32), tensors)
    assert f"{name}: shape {shape}" in str(error.value) and f"need {expected}" in str(error.value)


def test_bad_values_and_dtypes_are_named():
    tensors = checkpoint(torch.float32)
    name = "model.layers.0.mlp.experts."
    nan_scale = dict(tensors)
    nan_scale[name + "gate_up_proj_scales"] = tensors[name + "gate_up_proj_scales"].clone()
    nan_scale[name + "gate_up_proj_scales"][1, 2, 0] = 255
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: gate_up_proj_blocks .* no MXFP4 stack.*255"):
        use_mxfp4_experts(tiny_model(torch.float32), nan_scale)
    float_blocks = dict(tensors, **{name + "down_proj_blocks": tensors[name + "down_proj_blocks"].float()})
    with pytest.raises(ValueError, match="down_proj_blocks .* dtype torch.float32"):
        use_mxfp4_experts(tiny_model(torch.float32), float_blocks)
    int_bias = dict(tensors, **{name + "down_proj_bias": tensors[name + "down_proj_bias"].to(torch.int32)})
    with pytest.raises(ValueError, match="down_proj_bias: dtype torch.int32"):
        use_mxfp4_experts(tiny_model(torch.float32), int_bias)
    not_a_tensor = dict(tensors, **{name + "gate_up_proj_bias": [0.0] * 3})
    with pytest.raises(TypeError, match="gate_up_proj_bias.*expected a tensor, got list"):
        use_mxfp4_experts(tiny_model(torch.float32), not_a_tensor)


def test_sizes_that_are_no_multiple_of_32_are_refused():
    config = tiny_config()
    config.intermediate_size = 48
    model = GptOssForCausalLM(config)
    with pytest.raises(ValueError, match="intermediate_size=48 is no multiple of 32"):
        use_mxfp4_experts(model, quantize=True)


def test_module_constructor_checks_the_stacks_against_each_other():
    tensors = checkpoint(torch.float32)
    parts = {part: tensors["model.layers.0.mlp.experts." + part] for part in (
        "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks", "down_proj_scales",
        "down_proj_bias")}
    wide = Mxfp4Weights.quantize(torch.randn(E, H, 2 * I, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"down_proj_blocks: shape .* needs \(6, 64, 64\)"):
        TutelGptOssMxfp4Experts(**dict(parts, down_proj_blocks=wide.gpt_oss_blocks(), down_proj_scales=wide.scales))
    with pytest.raises(ValueError, match=r"gate_up_proj_bias: shape \(6, 64\); expected \(6, 128\)"):
        TutelGptOssMxfp4Experts(**dict(parts, gate_up_proj_bias=parts["down_proj_bias"]))
    module = TutelGptOssMxfp4Experts(**parts)
    x = torch.randn(3, H)
    with pytest.raises(TypeError, match="`routing_weights` is required"):
        module(x, torch.zeros(3, K, dtype=torch.int64))
    with pytest.raises(ValueError, match="`x`"):
        module(torch.randn(3, H + 1), torch.zeros(3, K, dtype=torch.int64), torch.ones(3, K))
    with pytest.raises(ValueError, match="expert_ids"):
        module(x, torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K))
    assert math.isclose(module.alpha, ALPHA) and module.limit == LIMIT
    assert "experts=6, hidden=64, intermediate=64" in repr(module)
