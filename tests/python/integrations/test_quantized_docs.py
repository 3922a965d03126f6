"""docs/quantized.md's examples run as written: the self-contained ones as they are, the ones that
start from a loaded model with a tiny model of that kind (a gpt-oss with its MXFP4 checkpoint
tensors; a model with transformers' FP8 experts), which is what their first comment says they take."""
import os
import re

import pytest
import torch

pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(HERE, "..", "..", "..", "docs", "quantized.md")

from transformers_test_setup import one_intra_op_thread  # noqa: E402,F401  (autouse fixture)

import test_gpt_oss_mxfp4 as gpt_oss  # noqa: E402
import test_transformers_fp8_experts as fp8  # noqa: E402


def examples():
    with open(PAGE) as handle:
        return re.findall(r"^```python\n(.*?)^```", handle.read(), flags=re.S | re.M)


def example(marker):
    found = [body for body in examples() if marker in body]
    assert len(found) == 1, f"docs/quantized.md must hold one example with {marker!r}"
    return found[0]


def run(body, **given):
    namespace = dict(given)
    exec(compile(body, "docs/quantized.md", "exec"), namespace)
    return namespace


def test_the_page_has_the_examples_this_file_runs():
    assert len(examples()) == 4


def test_the_routed_call_over_each_format_runs():
    namespace = run(example("routed_quantized_experts(x, expert_ids"))
    assert namespace["y"].shape == (namespace["T"], namespace["H"]) and namespace["y"].dtype == torch.bfloat16
    assert torch.isfinite(namespace["y"].float()).all()


def test_a_gpt_oss_model_takes_its_checkpoints_mxfp4_experts():
    eager, _, tensors = gpt_oss.model_pair(torch.bfloat16)
    prompt = gpt_oss.prompts()
    with torch.inference_mode():
        expected = eager.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model = gpt_oss.tiny_model(torch.bfloat16)
    gpt_oss.load_dequantized(model, tensors)
    namespace = run(example("use_mxfp4_experts(model, tensors)"), model=model, tensors=tensors, input_ids=prompt,
                    torch=torch)
    assert isinstance(model.model.layers[0].mlp.experts, gpt_oss.TutelGptOssMxfp4Experts)
    assert torch.equal(namespace["tokens"], expected)


def test_a_model_with_fp8_experts_is_enabled_both_ways():
    model, _ = fp8.fp8_model("qwen3_moe", (16, 16), torch.float32)
    run(example("tutel_hf.enable(model"), model=model)
    assert model.config._experts_implementation == "tutel"
    modules = [module for module in model.modules() if fp8.fp8_experts.is_fp8_experts(module)]
    assert modules and all(getattr(m, fp8.fp8_experts.FP8_ACTIVATIONS) == "weight_only" for m in modules)
    with torch.no_grad():
        model(torch.randint(3, fp8.VOCAB, (1, 4)))


def test_a_layer_quantizes_its_experts_in_place():
    namespace = run(example("quantize_experts("))
    layer = namespace["layer"]
    assert type(layer.experts).__name__ == "QuantizedSwiGLUExperts"
    assert namespace["y"].shape == namespace["x"].shape
    assert all(not name.endswith(("fc1_weight", "fc2_weight", "fc3_weight")) for name in layer.experts.state_dict())
