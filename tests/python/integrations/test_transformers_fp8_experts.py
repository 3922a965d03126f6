"""transformers' FP8 experts (FP8Experts, fine-grained FP8 checkpoints) with experts_implementation="tutel"
on the CPU: "tutel" in every experts registry (no KeyError at the first forward), the module read once
per state, its output against a float64 reference written here (weight-only, and W8A8 by DeepSeek-V3's
activation rule), greedy generation of tiny models against transformers' eager experts on the same
weights dequantized to bfloat16, and the refusals (tensors on two devices; static activation scales;
layouts and calls tutel cannot run).  The CUDA path's launches: test_quantized_cuda_launches.py.

On a CPU-only machine transformers dequantizes an FP8 checkpoint at load time, so the FP8 experts
are built here as transformers' quantizer builds them (``use_experts_implementation(FP8Experts,
experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)``) and filled with weights quantized by tutel.quant.
"""
import copy
import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers as tutel_hf  # noqa: E402
from tutel.integrations.transformers import fp8_experts  # noqa: E402
from tutel.quant import Fp8BlockWeights  # noqa: E402
from tutel.quant.codes import FLOAT8_E8M0FNU  # noqa: E402

import quant_spec  # noqa: E402
from tiny_transformers_models import VOCAB, build  # noqa: E402

H, I, E = 40, 12, 9  # no multiple of 16 or 128: partial blocks
SCALE_DTYPES = [torch.float32, torch.bfloat16] + ([FLOAT8_E8M0FNU] if FLOAT8_E8M0FNU is not None else [])


def fp8_class(**flags):
    """A subclass of transformers' FP8Experts declared as its quantizer declares it (a subclass, so
    the decorator leaves transformers' own class as it is)."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation
    return use_experts_implementation(experts_class=type("TinyFP8Experts", (FP8Experts,), {}),
                                      experts_interface=ALL_FP8_EXPERTS_FUNCTIONS, **flags)


def quantized(weight, block, scale_dtype, apart=False):
    """(codes, scales, float64 matrices) of a floating (E, N, K) stack quantized in `block`s, the
    matrices decoded by quant_spec from the codes and scales (the two halves of a [gate; up] stack
    quantized apart where `apart`)."""
    if apart:
        half = weight.shape[1] // 2
        parts = [quantized(part, block, scale_dtype) for part in (weight[:, :half], weight[:, half:])]
        return tuple(torch.cat(pieces, dim=1) for pieces in zip(*parts))
    stack = Fp8BlockWeights.quantize(weight, block=block or tuple(weight.shape[1:]), scale_dtype=scale_dtype)
    if stack.scale_inv.dtype == FLOAT8_E8M0FNU:
        scales = [[[quant_spec.e8m0_value(b) for b in row] for row in matrix]
                  for matrix in stack.scale_inv.view(torch.uint8).tolist()]
    else:
        scales = stack.scale_inv.to(torch.float64).tolist()
    return stack.weight, stack.scale_inv, quant_spec.decode_fp8_block(stack.weight, scales, stack.block)


def fill(module, name, codes, scales):
    setattr(module, name, torch.nn.Parameter(codes))
    setattr(module, name + "_scale_inv", torch.nn.Parameter(scales, requires_grad=scales.is_floating_point()))


def experts_module(block=(16, 16), scale_dtype=torch.float32, form="apart", scheme="dynamic", act="silu",
                   seed=0, flags=None):
    """(FP8 experts module with "tutel", float64 up matrices (E, U, H), float64 down matrices) of
    `form`: "apart" / "fused" [gate; up] quantization, or "up_only"."""
    import transformers
    config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, hidden_act=act,
                                         num_attention_heads=2, num_key_value_heads=1)
    config._experts_implementation = "tutel"
    gated = form != "up_only"
    with torch.device("meta"):
        module = fp8_class(**(flags or {}))(config, block_size=block, activation_scheme=scheme, has_gate=gated)
    generator = torch.Generator().manual_seed(seed)
    up = torch.randn(E, 2 * I if gated else I, H, generator=generator, dtype=torch.float64) * 0.3
    down = torch.randn(E, H, I, generator=generator, dtype=torch.float64) * 0.3
    up_codes, up_scales, up_matrices = quantized(up, block, scale_dtype, apart=form == "apart")
    down_codes, down_scales, down_matrices = quantized(down, block, scale_dtype)
    fill(module, "gate_up_proj" if gated else "up_proj", up_codes, up_scales)
    fill(module, "down_proj", down_codes, down_scales)
    return module, up_matrices, down_matrices


def inputs(tokens, k, dtype, seed=1, sentinels=False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=generator, dtype=torch.float64).to(dtype)
    ids = torch.rand(tokens, E, generator=generator).argsort(dim=1)[:, :k]
    if sentinels and tokens:
        ids[0, 0], ids[-1, k - 1] = E, E + 2  # other processes' choices (expert parallelism)
    weights = torch.rand(tokens, k, generator=generator, dtype=torch.float64).to(dtype)
    return x, ids, weights


def deepseek_activations(values, group):
    """DeepSeek-V3's act_quant in float64: per `group` columns, scale = float32(amax / 448), the
    values E4M3(value / scale) * scale."""
    out = values.clone()
    for start in range(0, values.shape[-1], group):
        part = values[..., start:start + group]
        scale = (part.abs().amax(dim=-1, keepdim=True) / 448).to(torch.float32).to(torch.float64)
        out[..., start:start + group] = (part / scale.clamp(min=1e-12)).to(torch.float8_e4m3fn).double() * scale
    return out


def reference(x, ids, weights, up, down, rule, dtype, groups=None):
    """sum over a token's choices of w * down_e(rule(up_e(x))) in float64, choice by choice.  With
    `groups` (the up and down products' activation groups): W8A8, each product's input quantized
    by deepseek_activations, the activations rounded to `dtype` where the products hand them on."""
    rounded = (lambda v: v.to(dtype).double()) if groups else (lambda v: v)
    act_up = (lambda v: deepseek_activations(v, groups[0])) if groups else (lambda v: v)
    act_down = (lambda v: deepseek_activations(v, groups[1])) if groups else (lambda v: v)
    y = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < up.shape[0]:
                hidden = rounded(rule(rounded(up[e] @ act_up(x[t].double()))))
                y[t] += float(weights[t, j]) * rounded(down[e] @ act_down(hidden))
    return y


def swiglu(h):
    gate, up = h.chunk(2)
    return F.silu(gate) * up


def assert_close_to(actual, expected, dtype, tolerance):
    assert actual.dtype == dtype and actual.shape == expected.shape
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance * scale)


WEIGHT_ONLY_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
W8A8_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-3}


# -- registration -----------------------------------------------------------------------------

def test_tutel_is_in_every_experts_registry():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS["tutel"] is tutel_hf.tutel_experts_forward
    assert ALL_FP8_EXPERTS_FUNCTIONS["tutel"] is tutel_hf.tutel_fp8_experts_forward
    registries = dict(tutel_hf.experts_registries())
    assert type(ALL_FP8_EXPERTS_FUNCTIONS) in registries


def test_registration_follows_the_registries_a_release_has(monkeypatch):
    """A release without the FP8 module registers the float experts only; a registry a release adds
    (a subclass with its own mapping) gets the FP8 forward; one sharing its parent's mapping is
    reached through the parent."""
    import sys
    from transformers.integrations.moe import ExpertsInterface
    monkeypatch.setitem(sys.modules, "transformers.integrations.finegrained_fp8", None)  # import -> ImportError
    classes = [cls for cls, _ in tutel_hf.experts_registries()]
    assert classes[0] is ExpertsInterface
    own = type("NewQuantExpertsInterface", (ExpertsInterface,), {"_global_mapping": {}})
    shared = type("SharedExpertsInterface", (ExpertsInterface,), {})
    registries = dict(tutel_hf.experts_registries())
    assert registries[own] is tutel_hf.tutel_fp8_experts_forward and shared not in registries
    tutel_hf.register()
    assert own._global_mapping["tutel"] is tutel_hf.tutel_fp8_experts_forward


def test_a_model_with_fp8_experts_runs_through_tutel_without_a_key_error():
    model, _ = fp8_model("qwen3_moe", block=(128, 128), scale_dtype=torch.float32)
    model.set_experts_implementation("tutel")
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 5, VOCAB) and torch.isfinite(logits).all()


def test_a_fresh_process_finds_tutel_for_fp8_experts():
    import subprocess
    import sys
    code = ("import torch, transformers, tutel.integrations.transformers\n"
            "from transformers.integrations.finegrained_fp8 import FP8Experts, ALL_FP8_EXPERTS_FUNCTIONS\n"
            "from transformers.integrations.moe import use_experts_implementation\n"
            "c = transformers.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, "
            "num_attention_heads=2, num_key_value_heads=1); c._experts_implementation = 'tutel'\n"
            "cls = use_experts_implementation(experts_class=type('F', (FP8Experts,), {}), "
            "experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)\n"
            "m = cls(c, block_size=(16, 16))\n"
            "with torch.no_grad():\n"
            "    for p in m.parameters(): p.copy_(torch.rand(p.shape).to(p.dtype))\n"
            "    print(m(torch.randn(3, 16), torch.tensor([[0, 1]] * 3), torch.rand(3, 2)).shape)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "torch.Size([3, 16])" in result.stdout, result.stderr


# -- the module against float64 -------------------------------------------------------------

@pytest.mark.parametrize("block, form", [((128, 128), "apart"), ((128, 128), "fused"), ((16, 16), "apart"),
                                         ((8, 8), "fused"), ((8, 8), "apart"), ((32, 16), "up_only"),
                                         (None, "apart"), (None, "fused")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_only_equals_the_float64_reference(block, form, dtype):
    module, up, down = experts_module(block, form=form)
    module.tutel_fp8_activations = "weight_only"
    x, ids, weights = inputs(17, 3, dtype)
    with torch.no_grad():
        y = module(x, ids, weights)
    rule = F.silu if form == "up_only" else swiglu
    assert_close_to(y, reference(x, ids, weights, up, down, rule, dtype), dtype, WEIGHT_ONLY_TOLERANCE[dtype])


@pytest.mark.parametrize("block, form", [((128, 128), "apart"), ((16, 16), "apart"), ((8, 8), "fused"),
                                         ((32, 16), "up_only"), (None, "fused")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dynamic_activations_equal_deepseeks_rule(block, form, dtype):
    module, up, down = experts_module(block, form=form, seed=3)
    x, ids, weights = inputs(17, 4, dtype, seed=4)
    with torch.no_grad():
        y = module(x, ids, weights)
    rule = F.silu if form == "up_only" else swiglu
    groups = (block[1], block[1]) if block else (H, I)  # the weight blocks' columns, or whole rows
    expected = reference(x, ids, weights, up, down, rule, dtype, groups)
    assert_close_to(y, expected, dtype, W8A8_TOLERANCE[dtype])
    weight_only = reference(x, ids, weights, up, down, rule, dtype)
    assert (weight_only - expected).abs().max() > 4 * W8A8_TOLERANCE[dtype] * expected.abs().max()


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [0, 1, 3, 17])
@pytest.mark.parametrize("k", range(1, 9))
def test_scale_dtypes_token_counts_choices_and_sentinels(scale_dtype, tokens, k):
    module, up, down = experts_module((16, 16), scale_dtype, seed=tokens + k)
    module._is_expert_parallel = True
    module.tutel_fp8_activations = "weight_only"
    x, ids, weights = inputs(tokens, k, torch.float32, seed=k, sentinels=True)
    with torch.no_grad():
        y = module(x, ids, weights)
    assert_close_to(y, reference(x, ids, weights, up, down, swiglu, torch.float32), torch.float32, 1e-5)


def test_a_gate_other_than_silu_runs_the_modules_gate():
    module, up, down = experts_module((16, 16), act="gelu_pytorch_tanh", seed=5)
    assert fp8_experts.read_fp8_layout(module).unit is None  # the module's _apply_gate, not the fused unit
    module.tutel_fp8_activations = "weight_only"
    x, ids, weights = inputs(9, 2, torch.float32)

    def rule(h):
        gate, value = h.chunk(2)
        return F.gelu(gate, approximate="tanh") * value
    with torch.no_grad():
        y = module(x, ids, weights)
    assert_close_to(y, reference(x, ids, weights, up, down, rule, torch.float32), torch.float32, 1e-5)


def test_up_only_parameters_decide_whatever_the_has_gate_flag_says():
    """transformers 5.23-5.24 reset has_gate to True on an FP8 module built without a gate."""
    module, up, down = experts_module((16, 16), form="up_only", flags=dict(has_gate=True), seed=6)
    assert module.has_gate is True and getattr(module, "gate_up_proj", None) is None
    module.tutel_fp8_activations = "weight_only"
    x, ids, weights = inputs(5, 2, torch.float32)
    with torch.no_grad():
        y = module(x, ids, weights)
    assert_close_to(y, reference(x, ids, weights, up, down, F.silu, torch.float32), torch.float32, 1e-5)


def test_transformers_own_fp8_experts_need_its_kernels():
    """transformers' FP8 experts (eager, grouped_mm, batched_mm) run the finegrained-fp8 Triton
    kernels from the kernels hub, which need a GPU: on a CPU there is nothing of theirs to compare
    with, so the tests above hold tutel to float64 references instead."""
    from transformers.utils.import_utils import is_kernels_available
    try:
        available = is_kernels_available()
    except ValueError:  # (5.7 fails on the version of any importable `kernels`, as this repository's folder)
        available = False
    if available:  # (asking would download the kernel)
        pytest.skip("needs a CUDA device: transformers' FP8 experts run the finegrained-fp8 Triton kernels")
    module, _, _ = experts_module((16, 16))
    x, ids, weights = inputs(3, 2, torch.bfloat16)
    for name in ("eager", "grouped_mm", "batched_mm"):
        module.config._experts_implementation = name
        with pytest.raises((ImportError, ValueError), match="finegrained-fp8|Invalid version"), torch.no_grad():
            module(x, ids, weights)


# -- whole models --------------------------------------------------------------------------------

def fp8_model(family, block, scale_dtype, dtype=torch.bfloat16, seed=0):
    """(model with FP8 experts, the same model with transformers' eager experts holding the FP8
    weights dequantized to `dtype`), a tiny random model of `family` (gate and up quantized apart,
    as DeepSeek-V3's checkpoints are)."""
    eager = build(family, dtype=dtype, seed=seed)
    model = copy.deepcopy(eager)
    for name, experts in list(eager.named_modules()):
        if not name.endswith(".experts"):
            continue
        with torch.device("meta"):  # (the copy's config: the one its set_experts_implementation sets)
            fp8 = fp8_class()(model.get_submodule(name).config, block_size=block, activation_scheme="dynamic")
        up_codes, up_scales, up = quantized(experts.gate_up_proj.detach().double(), block, scale_dtype, apart=True)
        down_codes, down_scales, down = quantized(experts.down_proj.detach().double(), block, scale_dtype)
        fill(fp8, "gate_up_proj", up_codes, up_scales)
        fill(fp8, "down_proj", down_codes, down_scales)
        model.set_submodule(name, fp8)
        with torch.no_grad():
            experts.gate_up_proj.copy_(up.to(dtype))
            experts.down_proj.copy_(down.to(dtype))
    return model, eager


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
# (E8M0 scales, powers of two, make the dequantized weights exact in bfloat16; a PyTorch without
# float8_e8m0fnu takes bfloat16 scales)
@pytest.mark.parametrize("block, scale_dtype", [((128, 128), FLOAT8_E8M0FNU or torch.bfloat16),
                                                ((16, 16), torch.float32)], ids=["128x128-ue8m0", "16x16-float32"])
def test_greedy_generation_equals_eager_experts_on_the_dequantized_weights(family, block, scale_dtype):
    model, eager = fp8_model(family, block, scale_dtype)
    tutel_hf.enable(model, fp8_activations="weight_only")
    assert model.config._experts_implementation == "tutel"
    prompt = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        theirs = eager.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        logits, eager_logits = model(ours).logits.double(), eager(ours).logits.double()
    assert torch.equal(ours, theirs)
    # Both bfloat16 models, rounding in different places; where a router's top-k is a near tie the
    # two can choose different experts for a token (tutel's float experts differ from the eager ones
    # there as much), so the logits agree on average, to about a bfloat16 step of the largest.
    assert float((logits - eager_logits).abs().mean()) < 5e-3 * float(eager_logits.abs().max())


def test_a_dynamic_model_generates_and_differs_from_weight_only():
    model, _ = fp8_model("qwen3_moe", (16, 16), torch.float32, dtype=torch.float32)
    tutel_hf.enable(model)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dynamic = model(prompt).logits
        tutel_hf.enable(model, fp8_activations="weight_only")
        weight_only = model(prompt).logits
    assert torch.isfinite(dynamic).all() and not torch.equal(dynamic, weight_only)
    torch.testing.assert_close(dynamic, weight_only, rtol=0.2, atol=0.2)  # W8A8 stays near


# -- the layout, read once -------------------------------------------------------------------

def test_the_layout_is_read_once_per_state_and_keeps_no_replaced_weight(monkeypatch):
    module, up, down = experts_module((16, 16))
    module.tutel_fp8_activations = "weight_only"
    reads = []
    real = fp8_experts.read_fp8_layout
    monkeypatch.setattr(fp8_experts, "read_fp8_layout", lambda m: reads.append(1) or real(m))
    x, ids, weights = inputs(4, 2, torch.float32)
    with torch.no_grad():
        first = module(x, ids, weights)
        module(x, ids, weights)
        assert len(reads) == 1
        with torch.no_grad():  # new values in place: read as they are, not read again
            module.down_proj.data = module.down_proj.data.clone()
            module.down_proj_scale_inv.mul_(2)
        torch.testing.assert_close(module(x, ids, weights), 2 * first, rtol=1e-6, atol=1e-6)
        assert len(reads) == 1
        old = weakref.ref(module.gate_up_proj)
        fill(module, "gate_up_proj", module.gate_up_proj.detach().clone(), module.gate_up_proj_scale_inv.detach())
        gc.collect()
        assert old() is None  # the kept layout held it weakly
        torch.testing.assert_close(module(x, ids, weights), 2 * first, rtol=1e-6, atol=1e-6)
        assert len(reads) == 2
        module.tutel_fp8_activations = "dynamic"  # an attribute changed: read again
        module(x, ids, weights)
        assert len(reads) == 3


# -- refusals --------------------------------------------------------------------------------

def test_static_activation_scales_are_refused_at_enable_and_at_the_first_call():
    module, _, _ = experts_module((16, 16), scheme="static")
    x, ids, weights = inputs(3, 2, torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r'TinyFP8Experts \(activation_scheme\): activation_scheme="static"'):
        with torch.no_grad():
            module(x, ids, weights)
    model, _ = fp8_model("qwen3_moe", (16, 16), torch.float32)
    for name, experts in model.named_modules():
        if name.endswith(".experts"):
            experts.activation_scheme = "static"
    with pytest.raises(NotImplementedError, match='activation_scheme="static".*fp8_activations="weight_only"'):
        tutel_hf.enable(model)
    tutel_hf.enable(model, fp8_activations="weight_only")  # the activations unquantized: no scales needed


def _fake_cuda(tensor):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cuda")


def test_fp8_experts_with_tensors_on_two_devices_are_refused():
    model, _ = fp8_model("qwen3_moe", (16, 16), torch.float32)
    experts = model.model.layers[0].mlp.experts
    experts.down_proj = torch.nn.Parameter(_fake_cuda(experts.down_proj))
    message = r"TinyFP8Experts \(down_proj\).*scale_inv: on cpu but weight on cuda:0; expected all tensors of one"
    with pytest.raises(fp8_experts.UnsupportedExpertsLayout, match=message):
        tutel_hf.enable(model)


def test_tokens_on_another_device_than_the_fp8_experts_are_refused():
    module, _, _ = experts_module((16, 16))
    x, ids, weights = inputs(3, 2, torch.bfloat16)
    with pytest.raises(ValueError, match=r"the tokens: on cuda:0, but the experts' stacks lie on cpu"):
        with torch.no_grad():
            module(_fake_cuda(x), ids, weights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
@pytest.mark.parametrize("tokens", [3, 40])
def test_fp8_experts_moved_to_a_cuda_device_equal_the_float64_reference(scheme, tokens):
    module, up, down = experts_module((16, 16), seed=3)
    module.tutel_fp8_activations = scheme
    module.cuda()
    x, ids, weights = inputs(tokens, 2, torch.bfloat16, seed=4)
    with torch.no_grad():
        y = module(x.cuda(), ids.cuda(), weights.cuda())
    groups = (16, 16) if scheme == "dynamic" else None
    tolerance = (W8A8_TOLERANCE if scheme == "dynamic" else WEIGHT_ONLY_TOLERANCE)[torch.bfloat16]
    assert_close_to(y.cpu(), reference(x, ids, weights, up, down, swiglu, torch.bfloat16, groups), torch.bfloat16,
                    tolerance)


def test_a_call_autograd_would_record_says_what_to_do():
    module, _, _ = experts_module((16, 16))
    x, ids, weights = inputs(3, 2, torch.bfloat16)
    y = module(x, ids, weights)  # grad mode on, nothing of the call requires grad (the FP8 weights do)
    assert y.grad_fn is None
    with pytest.raises(NotImplementedError, match=r"inference only.*torch\.no_grad\(\)"):
        module(x.requires_grad_(), ids, weights)


def _with(module, **changes):
    for name, value in changes.items():
        setattr(module, name, value)
    return module


@pytest.mark.parametrize("change, error, message", [
    (lambda m: _with(m, gate_up_proj=torch.nn.Parameter(m.gate_up_proj.detach().view(torch.int8),
                                                        requires_grad=False)),
     tutel_hf.UnsupportedExpertsLayout, r"\(gate_up_proj\): `gate_up_proj` must be float8_e4m3fn.*expert_dtype='fp4'"),
    (lambda m: _with(m, down_proj=torch.nn.Parameter(m.down_proj.detach().float())),
     tutel_hf.UnsupportedExpertsLayout, r"`down_proj` must be float8_e4m3fn FP8 codes, got torch.float32"),
    (lambda m: _with(m, up_proj=m.gate_up_proj), tutel_hf.UnsupportedExpertsLayout,
     r"\(has_gate\): expects one tensor of `gate_up_proj` .* the module has \['gate_up_proj', 'up_proj'\]"),
    (lambda m: _with(m, has_bias=True), tutel_hf.UnsupportedExpertsLayout, r"\(has_bias\): FP8 experts with biases"),
    (lambda m: _with(m, is_transposed=True), tutel_hf.UnsupportedExpertsLayout, r"\(is_transposed\)"),
    (lambda m: _with(m, block_size=(16, 0)), tutel_hf.UnsupportedExpertsLayout,
     r"\(block_size\): must be two integers > 0"),
    (lambda m: _with(m, block_size=(8, 8)), tutel_hf.UnsupportedExpertsLayout,
     r"\(gate_up_proj\): `gate_up_proj` and `gate_up_proj_scale_inv` are no block-FP8 stack"),
    (lambda m: _with(m, down_proj_scale_inv=torch.nn.Parameter(torch.full_like(m.down_proj_scale_inv, math.inf))),
     tutel_hf.UnsupportedExpertsLayout, r"\(down_proj\): .*non-finite scale"),
    (lambda m: _with(m, num_experts=E + 1), tutel_hf.UnsupportedExpertsLayout,
     r"\(num_experts\): `gate_up_proj` holds 9 experts but num_experts is 10"),
    (lambda m: _with(m, activation_scheme="per_tensor"), tutel_hf.UnsupportedExpertsLayout,
     r"\(activation_scheme\): must be \"dynamic\" or \"static\""),
    (lambda m: _with(m, tutel_fp8_activations="int8"), tutel_hf.UnsupportedExpertsLayout,
     r"\(tutel_fp8_activations\): must be one of"),
])
def test_a_layout_tutel_cannot_run_names_the_class_and_the_flag(change, error, message):
    module = change(experts_module((16, 16))[0])
    x, ids, weights = inputs(3, 2, torch.bfloat16)
    with pytest.raises(error, match=message), torch.no_grad():
        module(x, ids, weights)


@pytest.mark.parametrize("call, error, message", [
    (lambda x, i, w: (x[:, :-1], i, w), ValueError, r"takes tokens of 40 features, got hidden_states \(3, 39\)"),
    (lambda x, i, w: (x, i.float(), w), TypeError, "`top_k_index` must hold integer expert ids"),
    (lambda x, i, w: (x, i, w[:, :1]), ValueError, r"expects hidden_states \[T, H\], top_k_index \[T, k\]"),
    (lambda x, i, w: (x.int(), i, w), TypeError, "must be floating point"),
    (lambda x, i, w: (x.numpy(), i, w), TypeError, "`hidden_states` of type ndarray"),
])
def test_a_bad_call_names_the_argument(call, error, message):
    module, _, _ = experts_module((16, 16))
    x, ids, weights = inputs(3, 2, torch.float32)
    with pytest.raises(error, match=message), torch.no_grad():
        module(*call(x, ids, weights))


def test_fp8_activations_of_enable_is_checked():
    model, _ = fp8_model("qwen3_moe", (16, 16), torch.float32)
    with pytest.raises(ValueError, match=r"fp8_activations must be one of \('weight_only', 'dynamic'\) or None"):
        tutel_hf.enable(model, fp8_activations="w8a8")
    with pytest.raises(ValueError, match="applies to transformers' FP8 experts.*Qwen3MoeForCausalLM has none"):
        tutel_hf.enable(build("qwen3_moe"), fp8_activations="weight_only")
