"""replace_moe_blocks on tiny random float64 models of eight transformers families: the replaced
model's logits, the gradients of every parameter outside the MoE blocks and its greedy generation
equal the original model's; the switches, l_aux and state_dict work; bad input is refused with
the module or option named and the model left as it was."""
import pytest
import torch

import replace_models as rm
import tiny_transformers_models as tiny
from transformers_test_setup import skip_unless_released
from tutel.impls.moe_layer import MOELayer
from tutel.integrations.transformers import replace_moe_blocks
from tutel.integrations.transformers.block_layouts import UnsupportedMoeBlock
from tutel.integrations.transformers.replace import moe_aux_loss, set_moe_switches

TOL = dict(rtol=1e-10, atol=1e-10)
BLOCK_CLASSES = {"mixtral": "MixtralSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
                 "qwen3_moe": "Qwen3MoeSparseMoeBlock", "olmoe": "OlmoeSparseMoeBlock", "deepseek_v3": "DeepseekV3MoE",
                 "glm4_moe": "Glm4MoeMoE", "gpt_oss": "GptOssMLP", "llama4": "Llama4TextMoe"}


@pytest.mark.parametrize("family", rm.FAMILIES)
def test_replaced_model_equals_the_original(family):
    model, original, blocks = rm.original_and_copy(family)
    assert blocks and all(type(model.get_submodule(n)).__name__ == BLOCK_CLASSES[family] for n in blocks)
    experts = {name: model.get_submodule(name).experts for name in blocks}
    assert replace_moe_blocks(model) == len(blocks)
    assert all(isinstance(model.get_submodule(name), MOELayer) for name in blocks)
    assert not any(type(m).__name__ == BLOCK_CLASSES[family] for m in model.modules())

    ids = rm.tokens(1)
    expected, expected_grads = rm.logits_and_grads(original, ids, blocks)
    logits, grads = rm.logits_and_grads(model, ids, blocks)
    torch.testing.assert_close(logits, expected, **TOL)
    assert grads.keys() == expected_grads.keys() and len(grads) > 5
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **TOL, msg=lambda m: f"{family} {name}: {m}")
    for name in blocks:  # the routed experts' gradients, in the layer's layout
        expected_experts = rm.expert_grads_as_layer(original.get_submodule(name).experts, family)
        for attribute, grad in expected_experts.items():
            torch.testing.assert_close(getattr(model.get_submodule(name).experts, attribute).grad, grad, **TOL)
    assert all(p.grad is None for e in experts.values() for p in e.parameters() if family != "gpt_oss")
    assert torch.equal(rm.greedy(model, ids), rm.greedy(original, ids))
    assert moe_aux_loss(model) is not None  # every layer set l_aux in the last forward


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_output_router_logits_still_records_the_logits(family):
    skip_unless_released(f"{family}.router_logits")
    model, original, blocks = rm.original_and_copy(family)
    ids = rm.tokens(2)
    model(ids, output_router_logits=True)  # transformers' hooks already installed before the replacement
    replace_moe_blocks(model)
    expected = original(ids, labels=ids, output_router_logits=True)
    got = model(ids, labels=ids, output_router_logits=True)
    assert len(got.router_logits) == len(expected.router_logits) == len(blocks)
    # Mixtral's router logits are model-dtype; the replacement records them in float32
    tol = TOL if family == "gpt_oss" else dict(rtol=1e-6, atol=1e-6)
    for logits, wanted in zip(got.router_logits, expected.router_logits):
        torch.testing.assert_close(logits.double(), wanted.double(), **tol)
    if expected.aux_loss is not None:
        torch.testing.assert_close(got.aux_loss.double(), expected.aux_loss.double(), **tol)


def test_weights_are_shared_where_the_layouts_agree():
    model = rm.build("gpt_oss")
    block = model.model.layers[0].mlp
    router, experts = block.router, block.experts
    replace_moe_blocks(model)
    layer = model.model.layers[0].mlp
    assert layer.gates[0].wg.weight is router.weight and layer.gates[0].wg.bias is router.bias
    assert layer.experts.gate_up_proj is experts.gate_up_proj and layer.experts.down_proj_bias is experts.down_proj_bias

    model = rm.build("qwen2_moe")
    block = model.model.layers[1].mlp
    shared, shared_gate = block.shared_expert, block.shared_expert_gate
    replace_moe_blocks(model)
    layer = model.model.layers[1].mlp
    assert layer.shared_experts.up_proj.weight is shared.up_proj.weight
    assert layer.shared_experts.gate.weight is shared_gate.weight
    assert "model.layers.1.mlp.shared_experts.gate.weight" in model.state_dict()


def test_tuple_returning_blocks_keep_their_calling_convention():
    for family, second_shape in (("gpt_oss", lambda t, k, e: (t, k)), ("llama4", lambda t, k, e: (t, e))):
        model = rm.build(family)
        block = model.model.layers[0].get_submodule("mlp" if family == "gpt_oss" else "feed_forward")
        x = torch.randn(2, 5, 24, dtype=torch.float64)
        expected = block(x)
        replace_moe_blocks(model)
        layer = model.model.layers[0].get_submodule("mlp" if family == "gpt_oss" else "feed_forward")
        got = layer(x)
        assert isinstance(got, tuple) and len(got) == 2
        torch.testing.assert_close(got[0].reshape(expected[0].shape), expected[0], **TOL)
        assert got[1].shape == second_shape(10, layer.gates[0].top_k, layer.num_global_experts)
        if family == "gpt_oss":  # the routing weights, in the router's (descending) order
            torch.testing.assert_close(got[1], expected[1], **TOL)
        else:  # the router logits, float32 as Llama 4's scores
            torch.testing.assert_close(got[1], expected[1].float(), rtol=1e-6, atol=1e-6)


def test_switch_defaults_and_per_call_switches():
    # Qwen3-MoE renormalises over the chosen experts: top_k=1 equals the same model built with k = 1.
    model = rm.build("qwen3_moe")
    k1 = rm.build("qwen3_moe", num_experts_per_tok=1)
    assert replace_moe_blocks(model, top_k=1) == 2
    ids = rm.tokens(3)
    torch.testing.assert_close(model(ids).logits, k1(ids).logits, **TOL)
    layer = model.model.layers[0].mlp
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    assert not torch.allclose(layer(x, top_k=3), layer(x))  # a call's switch overrides the default
    dropped = layer(x, capacity_factor=0.25, top_k=3)
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, layer(x, top_k=3))
    assert layer.l_aux is not None and layer.l_aux.dim() == 0


def test_set_moe_switches_changes_the_models_own_forward():
    model, k1 = rm.build("qwen3_moe"), rm.build("qwen3_moe", num_experts_per_tok=1)
    original = rm.build("qwen3_moe")
    replace_moe_blocks(model)
    ids = rm.tokens(5)
    assert set_moe_switches(model, top_k=1) == 2
    torch.testing.assert_close(model(ids).logits, k1(ids).logits, **TOL)
    assert set_moe_switches(model, top_k=None) == 2  # back to the gate's k
    torch.testing.assert_close(model(ids).logits, original(ids).logits, **TOL)
    with pytest.raises(ValueError, match="layer 'model.layers.0.mlp'.*top_k=9 exceeds num_global_experts=7"):
        set_moe_switches(model, top_k=9)
    with pytest.raises(TypeError, match="unknown switch"):
        set_moe_switches(model, k=1)
    with pytest.raises(ValueError, match="no layer made by replace_moe_blocks"):
        set_moe_switches(original, top_k=1)
    torch.testing.assert_close(model(ids).logits, original(ids).logits, **TOL)  # the refused calls changed nothing


def test_state_dict_round_trip_between_replaced_models():
    source, target = rm.build("deepseek_v3", seed=0), rm.build("deepseek_v3", seed=5)
    replace_moe_blocks(source)
    replace_moe_blocks(target)
    ids = rm.tokens(4)
    assert not torch.allclose(source(ids).logits, target(ids).logits)
    target.load_state_dict(source.state_dict())
    torch.testing.assert_close(target(ids).logits, source(ids).logits, **TOL)
    assert "model.layers.1.mlp.gates.0.selection_bias.bias" in source.state_dict()


def test_a_model_without_moe_blocks_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=30, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no sparse-MoE block"):
        replace_moe_blocks(model)
    model = rm.build("olmoe")
    replace_moe_blocks(model)
    with pytest.raises(ValueError, match="no sparse-MoE block to replace \\(its MoE blocks are moe_layers already\\)"):
        replace_moe_blocks(model)


def test_a_switch_transformers_block_is_named_as_unknown():
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
    config = SwitchTransformersConfig(vocab_size=40, d_model=8, d_kv=4, d_ff=8, num_layers=2, num_decoder_layers=2,
                                      num_heads=2, num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1)
    model = SwitchTransformersForConditionalGeneration(config)
    with pytest.raises(UnsupportedMoeBlock, match="'encoder.block.0.layer.1.mlp' \\(SwitchTransformersSparseMLP\\)"):
        replace_moe_blocks(model)


@pytest.mark.parametrize("family, block_class", [("phimoe", "PhimoeSparseMoeBlock"),
                                                 ("granitemoe", "GraniteMoeMoE")])
def test_an_unknown_block_layout_is_refused(family, block_class):
    model = tiny.build(family)
    with pytest.raises(UnsupportedMoeBlock, match=f"'model.layers.0.[a-z_]+' \\({block_class}\\): no known layout"):
        replace_moe_blocks(model)
    assert not any(isinstance(m, MOELayer) for m in model.modules())


def _unchanged(model, blocks, block_class):
    return all(type(model.get_submodule(name)).__name__ == block_class for name in blocks)


def test_nothing_is_replaced_when_a_later_block_is_bad():
    model, _, blocks = rm.original_and_copy("qwen3_moe")
    model.model.layers[1].mlp.experts.act_fn = torch.nn.GELU()
    with pytest.raises(UnsupportedMoeBlock, match="'model.layers.1.mlp'.*only SiLU"):
        replace_moe_blocks(model)
    assert _unchanged(model, blocks, "Qwen3MoeSparseMoeBlock")


def test_a_block_laid_out_otherwise_is_refused_naming_the_family_and_the_release():
    import re
    import transformers
    model, _, blocks = rm.original_and_copy("qwen3_moe")
    del model.model.layers[1].mlp.experts.gate_up_proj  # as a release that stored the experts otherwise
    release = re.escape(transformers.__version__)
    with pytest.raises(UnsupportedMoeBlock, match=r"'model.layers.1.mlp' \(Qwen3MoeSparseMoeBlock\): .*gate_up_proj"
                                                  rf".* \(family qwen3_moe, transformers {release}\)$"):
        replace_moe_blocks(model)
    assert _unchanged(model, blocks, "Qwen3MoeSparseMoeBlock")


@pytest.mark.parametrize("change, words", [
    (dict(num_group=3), "n_group=3"),                       # 3 groups cannot split 8 experts
    (dict(num_group=4, topk_group=5), "topk_group=5"),      # more groups allowed than exist
    (dict(num_group=4, topk_group=1), "k=3 exceeds the 2 experts"),  # 1 group of 2 experts, k = 3
])
def test_contradictory_routing_in_a_later_block_is_refused(change, words):
    model = rm.build("deepseek_v3", num_hidden_layers=3)  # MoE blocks in layers 1 and 2
    blocks = rm.block_names(model)
    block = model.model.layers[2].mlp
    # transformers 5.13 moved the settings from the block (n_group) to the router (num_group)
    settings, spelt = (block.gate, {}) if hasattr(block.gate, "num_group") else (block, {"num_group": "n_group"})
    for name, value in change.items():
        setattr(settings, spelt.get(name, name), value)
    with pytest.raises(UnsupportedMoeBlock, match="'model.layers.2.mlp' \\(DeepseekV3MoE\\)") as raised:
        replace_moe_blocks(model)
    assert words in str(raised.value)
    assert _unchanged(model, blocks, "DeepseekV3MoE")


@pytest.mark.parametrize("switches, error, words", [
    (dict(top_k=5), UnsupportedMoeBlock, "k=5 exceeds the 4 experts"),   # n_group=4, topk_group=2: 4 allowed
    (dict(top_k=9), UnsupportedMoeBlock, "top_k=9 exceeds num_global_experts=8"),
    (dict(capacity_factor="big"), UnsupportedMoeBlock, "capacity_factor"),
    (dict(adaptive_r=3), UnsupportedMoeBlock, "adaptive_r=3"),
    (dict(bias_update_rate=-1.0), UnsupportedMoeBlock, "bias_update_rate"),
    (dict(balance_loss="load_importance"), UnsupportedMoeBlock, "load_importance"),  # needs softmax scores
    (dict(k=2), TypeError, "unknown option(s) ['k']"),
])
def test_contradictory_switches_are_refused(switches, error, words):
    model = rm.build("deepseek_v3")
    with pytest.raises(error) as raised:
        replace_moe_blocks(model, **switches)
    assert words in str(raised.value)
    assert _unchanged(model, rm.block_names(model), "DeepseekV3MoE")


def test_mixtral_router_jitter_is_refused():
    model = rm.build("mixtral")
    model.model.layers[0].mlp.jitter_noise = 0.1
    with pytest.raises(UnsupportedMoeBlock, match="'model.layers.0.mlp'.*router_jitter_noise=0.1"):
        replace_moe_blocks(model)


def test_documented_example_runs():
    import os
    import re
    page = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "integrations", "replace-moe-blocks.md")
    with open(page) as handle:
        (body,) = [b for b in re.findall(r"^```python\n(.*?)^```", handle.read(), flags=re.S | re.M)
                   if "replace_moe_blocks(model) == 2" in b]
    namespace = {}
    exec(compile(body, page, "exec"), namespace)
    assert namespace["y"].shape == (2, 10, 32) and isinstance(namespace["layer"], MOELayer)


def test_training_mode_equals_the_original_and_balances_with_the_selection_bias():
    from tutel import moe
    model, original, blocks = rm.original_and_copy("deepseek_v3")
    model.train()
    original.train()
    replace_moe_blocks(model)
    layer = model.get_submodule(blocks[0])
    assert layer.training
    ids = rm.tokens(6)
    torch.testing.assert_close(model(ids).logits, original(ids).logits, **TOL)
    bias_before = layer.gates[0].selection_bias.bias.clone()
    assert moe.update_selection_biases(model) == 1  # loads counted in the training call move the bias
    step = layer.gates[0].selection_bias.bias - bias_before
    assert step.abs().max() > 0 and torch.allclose(step.abs()[step != 0], torch.full_like(step[step != 0], 1e-3))
