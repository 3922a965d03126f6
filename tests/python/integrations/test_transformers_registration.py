"""How "tutel" is chosen (import, from_pretrained, set_experts_implementation, enable), and the
errors for layouts and calls it cannot run: the module class and the flag are named."""
import subprocess
import sys

import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers as tutel_hf  # noqa: E402

from tiny_transformers_experts import make_inputs, make_pair  # noqa: E402
from tiny_transformers_models import VOCAB, build  # noqa: E402


def test_import_tutel_does_not_import_transformers():
    code = ("import sys, tutel, tutel.integrations, tutel.experts, tutel.moe; "
            "assert 'transformers' not in sys.modules, 'imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_from_pretrained_and_set_experts_implementation_select_tutel(tmp_path):
    from transformers import AutoModelForCausalLM
    eager = build("qwen3_moe")
    eager.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, experts_implementation="tutel")
    assert loaded.config._experts_implementation == "tutel"
    switched = build("qwen3_moe")
    switched.set_experts_implementation("tutel")
    assert switched.config._experts_implementation == "tutel"
    calls = []
    import tutel.experts.routed as routed  # (the experts forward calls run_routed, which runs the path)
    run = routed.run
    routed.run = lambda *a, **k: calls.append("tutel") or run(*a, **k)
    try:
        ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = eager(ids).logits
            for model in (loaded.eval(), switched):
                torch.testing.assert_close(model(ids).logits, want, rtol=1e-10, atol=1e-10)
    finally:
        routed.run = run
    assert len(calls) == 2 * 2  # two models, two MoE layers each


def test_importing_the_integration_registers_tutel():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    assert ALL_EXPERTS_FUNCTIONS["tutel"] is tutel_hf.tutel_experts_forward
    assert ExpertsInterface()["tutel"] is tutel_hf.tutel_experts_forward  # every instance, not one mapping


def test_a_misspelt_name_is_refused_by_transformers_with_tutel_listed():
    model = build("mixtral")
    with pytest.raises(ValueError, match='"tutel"'):
        model.set_experts_implementation("tutl")


def test_enable_checks_every_experts_module_then_switches():
    model = build("olmoe")
    assert tutel_hf.enable(model) is model
    assert model.config._experts_implementation == "tutel"
    assert tutel_hf.check_model(model) == 2


def _dense_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=30, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def _llama4():
    from replace_models import build as build_replaceable
    return build_replaceable("llama4")


@pytest.mark.parametrize("model, words", [(_dense_llama, ["LlamaForCausalLM has no experts module tutel can run",
                                                          "no module of it is an experts class"]),
                                          (_llama4, ["Llama4ForCausalLM has no experts module tutel can run",
                                                     "'model.layers.0.feed_forward.experts' (Llama4TextExperts)",
                                                     "replace_moe_blocks"])], ids=["dense", "llama4"])
def test_enable_refuses_a_model_with_no_experts_module_tutel_can_run(model, words):
    model = model()
    before = model.config._experts_implementation
    for call in (tutel_hf.enable, tutel_hf.check_model):
        with pytest.raises(tutel_hf.NoExpertsModule) as error:
            call(model)
        assert all(w in str(error.value) for w in words), str(error.value)
    assert model.config._experts_implementation == before


class _PlainExperts(torch.nn.Module):
    """Stacked experts without @use_experts_implementation: transformers runs their own forward."""

    def __init__(self, experts):
        super().__init__()
        self.num_experts = experts.num_experts
        self.gate_up_proj, self.down_proj, self.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise NotImplementedError("not run by these tests")


def test_enable_warns_once_naming_the_experts_tutel_cannot_run():
    import warnings
    model = build("mixtral", num_hidden_layers=3)
    for layer in (1, 2):
        model.model.layers[layer].mlp.experts = _PlainExperts(model.model.layers[layer].mlp.experts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tutel_hf.enable(model) is model
        assert tutel_hf.check_model(model) == 1
    messages = [str(w.message) for w in caught if "tutel" in str(w.message)]
    assert len(messages) == 2 and messages[0] == messages[1], messages  # once per call
    assert "'model.layers.1.mlp.experts' (_PlainExperts), 'model.layers.2.mlp.experts' (_PlainExperts)" in \
        messages[0] and "the other 1 experts modules run through tutel" in messages[0], messages[0]
    assert model.config._experts_implementation == "tutel"


def _broken(change):
    _, module = make_pair("mixtral")
    change(module)
    return module


BROKEN = {
    "missing flag": (lambda m: delattr(m, "has_bias"), "has_bias", "use_experts_implementation"),
    "flag not a bool": (lambda m: setattr(m, "is_transposed", 1), "is_transposed", "True or False"),
    "bias declared, absent": (lambda m: setattr(m, "has_bias", True), "has_bias", "gate_up_proj_bias"),
    "no gate declared on a gated module": (lambda m: setattr(m, "has_gate", False), "has_gate", "up_proj"),
    "post norm declared, absent": (lambda m: setattr(m, "has_post_expert_norm", True), "has_post_expert_norm",
                                   "post_expert_norm"),
    "no activation": (lambda m: setattr(m, "act_fn", None), "act_fn", "act_fn"),
    "quantised weights": (lambda m: setattr(m, "down_proj", torch.nn.Parameter(
        torch.zeros(m.down_proj.shape, dtype=torch.int8), requires_grad=False)), "down_proj", "int8"),
    "wrong expert count": (lambda m: setattr(m, "num_experts", 4), "num_experts", "5 experts"),
    "transposed flag on F.linear weights": (lambda m: setattr(m, "is_transposed", True), "has_gate", "twice"),
    "interleaved halves of odd width": (lambda m: (setattr(m, "is_concatenated", False), setattr(
        m, "gate_up_proj", torch.nn.Parameter(m.gate_up_proj[:, :-1].detach()))), "has_gate", "twice"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_an_unsupported_layout_names_the_class_and_the_flag(case):
    change, flag, detail = BROKEN[case]
    module = _broken(change)
    with pytest.raises(tutel_hf.UnsupportedExpertsLayout) as error:
        module(*make_inputs(4, 2))
    message = str(error.value)
    assert "MixtralExperts" in message and f"({flag})" in message and detail in message, message
    assert error.value.module_class == "MixtralExperts" and error.value.flag == flag


def test_enable_fails_before_any_forward_on_an_unsupported_module():
    model = build("mixtral")
    model.model.layers[1].mlp.experts.act_fn = None
    with pytest.raises(tutel_hf.UnsupportedExpertsLayout, match=r"MixtralExperts \(act_fn\)"):
        tutel_hf.enable(model)
    assert model.config._experts_implementation != "tutel"


@pytest.mark.parametrize("bad", ["three-dimensional tokens", "index of another batch", "weights of another shape",
                                 "not a tensor", "tokens of another width"])
def test_bad_calls_name_the_module_class(bad):
    _, module = make_pair("gpt_oss")
    hidden, ids, weights = make_inputs(5, 2)
    args = {"three-dimensional tokens": (hidden[None], ids, weights),
            "index of another batch": (hidden, ids[:4], weights[:4]),
            "weights of another shape": (hidden, ids, weights[:, :1]),
            "not a tensor": (hidden, ids.tolist(), weights),
            "tokens of another width": (hidden[:, :-1], ids, weights)}[bad]
    with pytest.raises((ValueError, TypeError), match="GptOssExperts"):
        module(*args)


def test_float_expert_ids_are_refused():
    _, module = make_pair("mixtral")
    hidden, ids, weights = make_inputs(5, 2)
    with pytest.raises(TypeError, match="`top_k_index` must hold integer expert ids"):
        module(hidden, ids.double(), weights)
