"""moe_layer with quantized SwiGLU experts (tutel.experts.quantized_swiglu): built from packed stacks
(``{'type': 'quantized_swiglu', ...}``) or by ``layer.quantize_experts(format)`` on llama_ffn and
clamped_swiglu layers, in each format (block FP8, MXFP4, NVFP4).

The outputs are held to a float64 reference written here from the specification: the layer's own
routing (the experts its gate's logits choose, with the weights its combine used) and each stack's
``dequantize_reference(torch.float64)``, through the expert formula in plain PyTorch; and, in
float64, to the same moe_layer whose float experts hold exactly the dequantized weights.  Then the
state_dict round trip, the resident bytes (measured), dtype conversions that keep the codes, the
refused backward and the refused arguments.
"""
import copy
import io

import pytest
import torch
import torch.nn.functional as F

from tutel import moe
from tutel.experts.quantized_swiglu import QuantizedSwiGLUExperts
from tutel.ops.gated_units import SWIGLU, GatedUnit
from tutel.quant import FORMATS, Fp8BlockWeights

GPT_OSS = GatedUnit(1.702, 1.0, 7.0, interleaved=True)
CLAMPED_CONCATENATED = GatedUnit(1.702, 1.0, 1.5, interleaved=False)

# format name, quantizer options, (model_dim, hidden): odd sizes where the format allows them
FORMAT_CASES = {
    "fp8_16x16": ("fp8_block", dict(block=(16, 16)), (40, 13)),
    "fp8_default": ("fp8_block", {}, (40, 12)),
    "mxfp4": ("mxfp4", {}, (64, 32)),
    "nvfp4": ("nvfp4", {}, (48, 16)),
}
# experts kind: (gate apart, unit, biases)
KINDS = {
    "llama_apart": (True, SWIGLU, False),
    "llama_apart_biased": (True, SWIGLU, True),  # up_bias [E, 2I] over [gate | up]
    "swiglu_fused": (False, SWIGLU, False),
    "gpt_oss_biased": (False, GPT_OSS, True),
    "clamped_concatenated": (False, CLAMPED_CONCATENATED, False),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}


# -- the reference ---------------------------------------------------------------------------

def reference_unit(gate_up, unit, activation=None):
    """The gated unit on [..., 2I] float64 values (gate and up halves, or alternating)."""
    if unit.interleaved:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if activation is not None:
        return activation(gate) * up
    if unit.limit is not None:
        gate = gate.clamp(max=unit.limit)
        up = up.clamp(min=-unit.limit, max=unit.limit)
    return (up + unit.up_offset) * gate * torch.sigmoid(unit.alpha * gate)


def reference_output(x, ids, weights, matrices, unit, activation=None):
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) in float64, expert by expert.  `matrices`:
    float64 'gate' (or None), 'up', 'down' stacks (E, out, in) and 'up_bias' / 'down_bias' (or None)."""
    y = torch.zeros(x.shape[0], matrices["down"].shape[1], dtype=torch.float64)
    for e in range(matrices["up"].shape[0]):
        token, choice = (ids == e).nonzero(as_tuple=True)
        rows = x[token].double()
        gate_up = rows @ matrices["up"][e].t()
        if matrices["gate"] is not None:
            gate_up = torch.cat((rows @ matrices["gate"][e].t(), gate_up), dim=1)
        if matrices["up_bias"] is not None:
            gate_up = gate_up + matrices["up_bias"][e]
        out = reference_unit(gate_up, unit, activation) @ matrices["down"][e].t()
        if matrices["down_bias"] is not None:
            out = out + matrices["down_bias"][e]
        y.index_put_((token,), weights[token, choice].double().unsqueeze(1) * out, accumulate=True)
    return y


def routing_of(layer, x, result, k):
    """The experts the layer's gate chose ([T, k]) and the weights its combine used ([T, k]), from
    the gate's logits (Tutel's rule: the top k of softmax(logits)); checked against the counts."""
    scores = F.softmax(result.logits, dim=1)
    ids = torch.topk(scores, k, dim=1).indices
    weights = torch.stack(list(result.weights), dim=1)
    counts = torch.bincount(ids.reshape(-1), minlength=layer.num_global_experts)
    assert torch.equal(counts, result.dispatch_count.to(counts.dtype))
    return ids, weights


def assert_close_to(actual, expected, dtype):
    assert actual.dtype == dtype and actual.shape == expected.shape
    tol = TOLERANCE[dtype]
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * scale)


# -- building layers -------------------------------------------------------------------------

def random_stacks(kind, format_case, experts, seed=0):
    """(the quantized_swiglu options: the stacks this test quantized, biases, unit; the float64
    matrices the reference takes: the stacks' dequantize_reference and the biases)."""
    apart, unit, biased = KINDS[kind]
    name, options, (model_dim, hidden) = FORMAT_CASES[format_case]
    generator = torch.Generator().manual_seed(seed)

    def weights(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * 0.3

    quantize = FORMATS[name].quantize
    rows = None if apart else ("interleaved" if unit.interleaved else "concatenated")
    stacks = {"gate_weight": quantize(weights(experts, hidden, model_dim), **options) if apart else None,
              "up": quantize(weights(experts, hidden * (1 if apart else 2), model_dim), gate_up_rows=rows, **options),
              "down": quantize(weights(experts, model_dim, hidden), **options)}
    biases = {"up_bias": weights(experts, 2 * hidden).float() if biased else None,
              "down_bias": weights(experts, model_dim).float() if biased else None}
    matrices = {"gate": None if stacks["gate_weight"] is None else stacks["gate_weight"].dequantize_reference(),
                "up": stacks["up"].dequantize_reference(), "down": stacks["down"].dequantize_reference(),
                **{key: None if bias is None else bias.double() for key, bias in biases.items()}}
    return dict(stacks, **biases, unit=unit), matrices


def packed_layer(kind, format_case, experts, k, capacity_factor=0.0, seed=0, **layer_options):
    """(moe_layer over stacks this test made, the reference's float64 matrices)."""
    options, matrices = random_stacks(kind, format_case, experts, seed)
    model_dim = FORMAT_CASES[format_case][2][0]
    # (fp32_gate: float32 logits, so that bfloat16 layers have no ties among the scores the reference re-ranks)
    gate = {"type": "top", "k": k, "capacity_factor": capacity_factor, "fp32_gate": True}
    layer = moe.moe_layer(gate_type=gate, model_dim=model_dim,
                          experts={"type": "quantized_swiglu", "num_experts_per_device": experts, **options},
                          seeds=(seed + 1, seed + 2), **layer_options)
    return layer, matrices


def tokens(count, model_dim, dtype, seed=3):
    return torch.randn(count, model_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def in_dtype(matrices, dtype):
    """The reference's matrices with the biases rounded to `dtype`, as a layer converted to it holds them."""
    return {key: value if value is None or key not in ("up_bias", "down_bias") else value.to(dtype).double()
            for key, value in matrices.items()}


# -- against the float64 reference -------------------------------------------------------------

EXPERTS_AND_K = [(1, 1), (5, 2), (5, 4), (16, 1), (16, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("experts, k", EXPERTS_AND_K)
@pytest.mark.parametrize("format_case", list(FORMAT_CASES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_layer_over_packed_stacks_equals_the_float64_reference(kind, format_case, experts, k, dtype):
    layer, matrices = packed_layer(kind, format_case, experts, k)
    layer = layer.to(dtype).eval()
    matrices = in_dtype(matrices, dtype)
    unit = KINDS[kind][1]
    model_dim = FORMAT_CASES[format_case][2][0]
    for count in (0, 1, 3, 37):
        x = tokens(count, model_dim, dtype, seed=count)
        for switches in ({}, {"megablocks_size": 1}):  # Tutel's slots, and the grouped rows in pieces
            with torch.no_grad():
                y, result = layer.forward_with_result(x, **switches)
            assert y.shape == (count, model_dim) and y.dtype == dtype
            if count == 0:
                continue
            ids, weights = routing_of(layer, x, result, k)
            assert_close_to(y, reference_output(x, ids, weights, matrices, unit), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("format_case", list(FORMAT_CASES))
@pytest.mark.parametrize("expert_type", ["llama_ffn", "llama_ffn_gelu", "clamped_swiglu",
                                         "clamped_swiglu_concatenated"])
def test_quantize_experts_quantizes_each_matrix_and_equals_the_reference(expert_type, format_case, dtype):
    name, options, (model_dim, hidden) = FORMAT_CASES[format_case]
    experts, k = 5, 2
    config = {"type": expert_type.split("_gelu")[0].replace("_concatenated", ""), "num_experts_per_device": experts,
              "hidden_size_per_expert": hidden}
    if expert_type == "llama_ffn_gelu":
        config["activation_fn"] = F.gelu
    if expert_type == "clamped_swiglu_concatenated":
        config.update(interleaved=False, limit=None, alpha=1.3)
    layer = moe.moe_layer(gate_type={"type": "top", "k": k, "capacity_factor": 0.0, "fp32_gate": True},
                          model_dim=model_dim, experts=config, seeds=(1, 2)).to(dtype).eval()
    floats = layer.experts
    if config["type"] == "llama_ffn":
        w1, w2, w3 = (getattr(floats, n).detach().view(s) for n, s in floats.full_shapes.items())
        expected = {"gate": w1, "up": w2, "down": w3}
        unit, activation = SWIGLU, (F.gelu if expert_type == "llama_ffn_gelu" else None)
        biases = {"up_bias": None, "down_bias": None}
        rows = {}
    else:
        expected = {"up": floats.gate_up_proj.detach(), "down": floats.down_proj.detach()}
        unit = GatedUnit(floats.alpha, 1.0, floats.limit, floats.interleaved)
        activation = None
        biases = {"up_bias": floats.gate_up_proj_bias.detach().double(),
                  "down_bias": floats.down_proj_bias.detach().double()}
        rows = {"up": "interleaved" if floats.interleaved else "concatenated"}
    # the test's own stacks of the float matrices ([L, in, out] as x @ W -> (E, out, in))
    ours = {role: FORMATS[name].quantize(matrix.transpose(1, 2), gate_up_rows=rows.get(role), **options)
            for role, matrix in expected.items()}
    assert layer.quantize_experts(name, **options) is layer
    assert isinstance(layer.experts, QuantizedSwiGLUExperts) and layer.experts.format == name
    assert not any(True for _ in layer.experts.parameters())  # the float experts are gone
    for role, stack in ours.items():
        held = layer.experts.stack(role)
        assert held.metadata() == stack.metadata()
        for tensor_name, tensor in stack.tensors().items():
            assert torch.equal(held.tensors()[tensor_name].view(torch.uint8), tensor.view(torch.uint8)), role
    matrices = {"gate": None, **{role: stack.dequantize_reference() for role, stack in ours.items()}, **biases}
    x = tokens(11, model_dim, dtype)
    with torch.no_grad():
        y, result = layer.forward_with_result(x)
    ids, weights = routing_of(layer, x, result, k)
    assert_close_to(y, reference_output(x, ids, weights, matrices, unit, activation), dtype)


@pytest.mark.parametrize("format_case", ["fp8_16x16", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("expert_type", ["llama_ffn", "clamped_swiglu"])
@pytest.mark.parametrize("switches", [dict(capacity_factor=1.0), dict(capacity_factor=0.0), dict(capacity_factor=-1.5),
                                      dict(capacity_factor=1.0, megablocks_size=2)], ids=str)
def test_float64_equals_the_layer_whose_float_experts_hold_the_dequantized_weights(expert_type, format_case,
                                                                                      switches):
    """Any capacity (tokens dropped alike), Tutel's slots and the grouped rows."""
    name, options, (model_dim, hidden) = FORMAT_CASES[format_case]
    floats = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=model_dim, seeds=(1, 2),
                           experts={"type": expert_type, "num_experts_per_device": 6,
                                    "hidden_size_per_expert": hidden}).double().eval()
    quantized = copy.deepcopy(floats).quantize_experts(name, **options)
    stacks = quantized.experts.stacks()
    with torch.no_grad():  # the float experts now hold exactly the dequantized matrices
        if expert_type == "llama_ffn":
            for parameter, role in (("W_fc1", "gate"), ("W_fc2", "up"), ("W_fc3", "down")):
                matrix = stacks[role].dequantize_reference().transpose(1, 2)
                getattr(floats.experts, parameter).copy_(matrix.reshape(-1))
        else:
            floats.experts.gate_up_proj.copy_(stacks["up"].dequantize_reference().transpose(1, 2))
            floats.experts.down_proj.copy_(stacks["down"].dequantize_reference().transpose(1, 2))
    x = tokens(29, model_dim, torch.float64)
    with torch.no_grad():
        expected, actual = floats(x, **switches), quantized(x, **switches)
    assert_close_to(actual, expected.double(), torch.float64)


# -- checkpoints, bytes, dtypes ------------------------------------------------------------------

@pytest.mark.parametrize("format_case", list(FORMAT_CASES))
@pytest.mark.parametrize("kind", ["llama_apart", "gpt_oss_biased"])
def test_state_dict_round_trips_the_packed_tensors(kind, format_case):
    layer, _ = packed_layer(kind, format_case, 5, 2, seed=0)
    other, _ = packed_layer(kind, format_case, 5, 2, seed=7)  # same formats and shapes, other values
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    for name in layer.experts.packed_names():
        stored = state["experts." + name]
        assert stored.dtype == getattr(layer.experts, name).dtype
        assert torch.equal(stored.view(torch.uint8), getattr(layer.experts, name).view(torch.uint8))
    other.load_state_dict(state)
    x = tokens(13, FORMAT_CASES[format_case][2][0], torch.float32)
    with torch.no_grad():
        assert torch.equal(other(x), layer(x))


def test_a_checkpoint_of_another_dtype_is_refused_not_converted():
    layer, _ = packed_layer("llama_apart", "fp8_16x16", 3, 1)
    state = layer.state_dict()
    state["experts.up_scale_inv"] = state["experts.up_scale_inv"].to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="up_scale_inv.*bfloat16"):
        layer.load_state_dict(state)


def test_a_checkpoint_with_invalid_scales_is_refused():
    layer, _ = packed_layer("llama_apart", "fp8_16x16", 3, 1)
    state = layer.state_dict()
    state["experts.down_scale_inv"] = state["experts.down_scale_inv"].clone()
    state["experts.down_scale_inv"][1, 0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite scale"):
        layer.load_state_dict(state)


@pytest.mark.parametrize("format_case", list(FORMAT_CASES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_resident_bytes_are_the_packed_bytes_plus_the_biases(kind, format_case):
    options, _ = random_stacks(kind, format_case, 4)
    layer, _ = packed_layer(kind, format_case, 4, 2)
    experts = layer.experts
    resident = sum(t.numel() * t.element_size() for t in list(experts.parameters()) + list(experts.buffers()))
    packed = sum(options[role].packed_bytes() for role in ("gate_weight", "up", "down") if options[role] is not None)
    biases = sum(options[b].numel() * options[b].element_size() for b in ("up_bias", "down_bias")
                 if options[b] is not None)
    assert resident == packed + biases == experts.packed_bytes() + biases


def test_quantizing_a_layer_releases_the_float_experts():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=64,
                          experts={"type": "llama_ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 32})
    float_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    weak = [torch.utils.weak.WeakTensorKeyDictionary()]
    for parameter in layer.experts.parameters():
        weak[0][parameter] = True
    del parameter
    layer.quantize_experts("mxfp4")
    assert len(weak[0]) == 0  # no reference to the float parameters is left
    assert not any(key.startswith("experts.W_fc") for key in layer.state_dict())
    resident = sum(t.numel() * t.element_size() for t in layer.experts.buffers())
    assert resident == layer.experts.packed_bytes() and 7 * resident < float_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_converting_the_layer_keeps_the_codes_and_scales_and_converts_the_biases(dtype):
    layer, _ = packed_layer("gpt_oss_biased", "fp8_default", 3, 2)
    before = {name: tensor.clone() for name, tensor in layer.experts.named_buffers()}
    layer.to(dtype)
    for name in layer.experts.packed_names():
        after = getattr(layer.experts, name)
        assert after.dtype == before[name].dtype and torch.equal(after.view(torch.uint8),
                                                                 before[name].view(torch.uint8))
    assert layer.experts.up_bias.dtype == dtype and layer.experts.down_bias.dtype == dtype


# -- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("switches", [{}, {"megablocks_size": 1}], ids=str)
def test_a_call_autograd_would_record_through_the_experts_is_refused(switches):
    layer, _ = packed_layer("llama_apart", "mxfp4", 4, 2)
    x = tokens(5, 64, torch.float32).requires_grad_()
    with pytest.raises(NotImplementedError, match=r"torch.no_grad\(\).*inference_mode\(\).*dequantize"):
        layer(x, **switches)
    gated_at_dispatch, _ = packed_layer("llama_apart", "mxfp4", 4, 2, is_postscore=False)
    with pytest.raises(NotImplementedError, match="inference only"):
        gated_at_dispatch(tokens(5, 64, torch.float32))  # the routing weights scale the experts' inputs
    with torch.no_grad():
        layer(x, **switches)
    with torch.inference_mode():
        layer(x.detach(), **switches)


def test_the_router_still_trains_on_fixed_quantized_experts():
    """Nothing records through the experts: the gate's gradient flows through the combine weights."""
    layer, _ = packed_layer("llama_apart", "mxfp4", 4, 2)
    y = layer(tokens(5, 64, torch.float32))
    y.sum().backward()
    assert layer.gates[0].wg.weight.grad is not None and bool(layer.gates[0].wg.weight.grad.abs().sum() > 0)


def simple_layer(**experts):
    return moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=experts.pop("model_dim", 64),
                         experts={"type": "llama_ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 32,
                                  **experts})


@pytest.mark.parametrize("make, call, error, message", [
    (simple_layer, lambda l: l.quantize_experts("int4"), ValueError, "format='int4'"),
    (simple_layer, lambda l: l.quantize_experts("mxfp4", block=(32, 32)), ValueError, r"\['block'\]"),
    (simple_layer, lambda l: l.quantize_experts("fp8_block", blocks=(32, 32)), ValueError, r"\['blocks'\]"),
    (lambda: simple_layer(model_dim=40), lambda l: l.quantize_experts("mxfp4"), ValueError, "model_dim=40"),
    (lambda: simple_layer(hidden_size_per_expert=24), lambda l: l.quantize_experts("nvfp4"), ValueError,
     "hidden_size_per_expert=24"),
    (simple_layer, lambda l: l.quantize_experts("mxfp4", activations="dynamic"), ValueError, "block-FP8"),
    (simple_layer, lambda l: l.quantize_experts("fp8_block", activations="w4a4"), ValueError, "activations"),
    (simple_layer, lambda l: l.quantize_experts("fp8_block", block=(0, 16)), ValueError, "block"),
    (lambda: moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=32,
                           experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 32}),
     lambda l: l.quantize_experts("fp8_block"), TypeError, "FusedExpertsNetwork"),
], ids=["format", "fp4-option", "fp8-option", "model_dim", "hidden", "dynamic-fp4", "activations", "block", "ffn"])
def test_bad_quantize_arguments_name_the_argument_and_leave_the_layer(make, call, error, message):
    layer = make()
    experts = layer.experts
    with pytest.raises(error, match=message):
        call(layer)
    assert layer.experts is experts


def _stacks(experts=3, model_dim=32, hidden=16):
    quantize = Fp8BlockWeights.quantize
    return dict(up=quantize(torch.randn(experts, hidden, model_dim)),
                down=quantize(torch.randn(experts, model_dim, hidden)),
                gate_weight=quantize(torch.randn(experts, hidden, model_dim)))


@pytest.mark.parametrize("change, error, message", [
    (dict(up=torch.zeros(3, 16, 32)), TypeError, "`up` must be a tutel.quant stack"),
    (dict(num_experts_per_device=4), ValueError, "num_experts_per_device=4"),
    (dict(model_dim=48), ValueError, "model_dim is 48"),
    (dict(down=Fp8BlockWeights.quantize(torch.randn(3, 32, 8))), ValueError, "`down`"),
    (dict(gate_weight=Fp8BlockWeights.quantize(torch.randn(3, 8, 32))), ValueError, "`gate_weight`"),
    (dict(gate_weight=None, up=Fp8BlockWeights.quantize(torch.randn(3, 31, 32))), ValueError, "2 x hidden rows"),
    (dict(gate_weight=None, up=Fp8BlockWeights.quantize(torch.randn(3, 32, 32), gate_up_rows="interleaved")),
     ValueError, "interleaved"),
    (dict(unit=GatedUnit(interleaved=True)), ValueError, "must not be interleaved"),
    (dict(unit=GatedUnit(limit=-1.0)), ValueError, "limit"),
    (dict(activations="dynamic", up=FORMATS["mxfp4"].quantize(torch.randn(3, 16, 32)),
          gate_weight=FORMATS["mxfp4"].quantize(torch.randn(3, 16, 32))), ValueError, "`up` is Mxfp4Weights"),
    (dict(activations="int8"), ValueError, "`activations`"),
    (dict(gate_weight=None, up=Fp8BlockWeights.quantize(torch.randn(3, 32, 32)), up_bias=torch.zeros(3, 31)),
     ValueError, "`up_bias` has shape"),
    (dict(up_bias=torch.zeros(3, 16)), ValueError, r"`up_bias` has shape \(3, 16\); expected \(3, 32\)"),
    (dict(gate_weight=None, up=Fp8BlockWeights.quantize(torch.randn(3, 32, 32)),
          down_bias=torch.zeros(3, 32, dtype=torch.int32)), ValueError, "`down_bias`"),
    (dict(sharded_count=2), ValueError, "whole experts"),
])
def test_bad_stacks_name_the_argument(change, error, message):
    arguments = dict(model_dim=32, num_experts_per_device=3, **_stacks())
    arguments.update(change)
    with pytest.raises(error, match=message):
        QuantizedSwiGLUExperts(**arguments)


def test_the_experts_dict_builds_the_same_experts():
    stacks = _stacks()
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=32,
                          experts={"type": "quantized_swiglu", "num_experts_per_device": 3, **stacks})
    assert isinstance(layer.experts, QuantizedSwiGLUExperts) and layer.experts.format == "fp8_block"
    with pytest.raises(ValueError, match="num_experts_per_device=2"):
        moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=32,
                      experts={"type": "quantized_swiglu", "num_experts_per_device": 2, **stacks})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["llama_apart", "gpt_oss_biased"])
@pytest.mark.parametrize("count", [5, 37])
def test_a_layer_on_cuda_equals_the_float64_reference(kind, count):
    layer, matrices = packed_layer(kind, "mxfp4", 4, 2)
    layer = layer.cuda().eval()
    assert layer.experts.up_packed.device.type == "cuda" and layer.experts.up_packed.dtype == torch.uint8
    x = tokens(count, 64, torch.float32)
    with torch.no_grad():
        y, result = layer.forward_with_result(x.cuda())
    ids, weights = routing_of(layer, x, result, 2)
    assert_close_to(y.cpu(), reference_output(x, ids.cpu(), weights.cpu(), matrices, KINDS[kind][1]),
                    torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_pieces_count_the_up_projection_as_the_products_return_it(dtype):
    """The grouped paths cut pieces by one row's up projection in bytes: the [gate | up] values of a
    row as the experts' products return them, in the rows' dtype (not float32 for 16-bit rows)."""
    from tutel.ops.quantized_experts import _stack_product
    layer, _ = packed_layer("swiglu_fused", "mxfp4", 4, 2)
    up = layer.experts.stack("up")
    rows = tokens(3, 64, dtype)
    projection = _stack_product(rows, [3, 3, 3, 3], up, None, False)
    assert layer.experts.grouped_products(None, dtype)[1] == projection.shape[1] * projection.element_size()


def test_tokens_on_another_device_than_the_experts_are_refused():
    from torch._subclasses.fake_tensor import FakeTensorMode
    layer, _ = packed_layer("llama_apart", "mxfp4", 4, 2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(5, 64, device="cuda")
    with pytest.raises(ValueError, match=r"the tokens: on cuda:0, but the experts' stacks lie on cpu"):
        layer.experts.grouped_products(None, torch.float32)[0](x, None)
