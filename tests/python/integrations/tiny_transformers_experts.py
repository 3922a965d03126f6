"""Stand-alone transformers experts modules, one per layout flag, with random parameters.

Each case is a real transformers experts class (its own forward is the reference) except the
interleaved default-gate layout, which no family uses yet: that class is declared here with the
decorator and a plain forward that reads the rows as [g0, u0, g1, u1, ...]."""
import copy

import torch
import torch.nn.functional as F

from transformers_test_setup import skip_unless_released

H, I, E = 12, 7, 5  # hidden, intermediate, experts
SIZES = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=1)


def _interleaved_gelu_class():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(is_concatenated=False)
    class InterleavedGeluExperts(torch.nn.Module):
        """Gate and up rows interleaved, default gate rule with a GELU."""

        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            self.gate_up_proj = torch.nn.Parameter(torch.empty(E, 2 * I, H))
            self.down_proj = torch.nn.Parameter(torch.empty(E, H, I))
            self.act_fn = torch.nn.GELU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[0]):
                for j in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, j])
                    if e >= self.num_experts:
                        continue
                    gate_up = F.linear(hidden_states[t], self.gate_up_proj[e])
                    inner = self.act_fn(gate_up[0::2]) * gate_up[1::2]
                    out[t] = out[t] + top_k_weights[t, j] * F.linear(inner, self.down_proj[e])
            return out

    return InterleavedGeluExperts


def _config(kind):
    import transformers
    if kind == "interleaved_gelu":
        return transformers.PreTrainedConfig()
    if kind == "nemotron_h":
        return transformers.NemotronHConfig(**SIZES, n_routed_experts=E, moe_intermediate_size=I,
                                            mlp_hidden_act="relu2")
    if kind == "muse_spark":
        return transformers.MuseSparkTextConfig(**SIZES, moe_hidden_size=H, num_local_experts=E,
                                                moe_intermediate_size=I)
    if kind == "aria":
        return transformers.AriaTextConfig(**SIZES, moe_num_experts=E, intermediate_size=I)
    if kind == "openai_privacy_filter":
        from transformers.models.openai_privacy_filter import OpenAIPrivacyFilterConfig
        return OpenAIPrivacyFilterConfig(**SIZES, num_local_experts=E, intermediate_size=I, swiglu_limit=1.5)
    if kind == "deepseek_v4":
        from transformers.models.deepseek_v4 import DeepseekV4Config
        # a clamp limit the random activations cross, so the clamp is exercised
        return DeepseekV4Config(**SIZES, n_routed_experts=E, num_local_experts=E, moe_intermediate_size=I,
                                swiglu_limit=1.0)
    if kind == "mixtral":
        return transformers.MixtralConfig(**SIZES, num_local_experts=E, intermediate_size=I)
    if kind == "gpt_oss":
        return transformers.GptOssConfig(**SIZES, num_local_experts=E, intermediate_size=I, swiglu_limit=1.5)
    raise KeyError(kind)


def _class(kind):
    if kind == "interleaved_gelu":
        return _interleaved_gelu_class()
    import importlib
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    names = {"nemotron_h": "NemotronHExperts", "muse_spark": "MuseSparkExperts", "aria": "AriaExperts",
             "openai_privacy_filter": "OpenAIPrivacyFilterExperts", "deepseek_v4": "DeepseekV4Experts",
             "mixtral": "MixtralExperts", "gpt_oss": "GptOssExperts"}
    return getattr(module, names[kind])


# case -> the layout it exercises
CASES = {
    "nemotron_h": "has_gate=False (up_proj, relu^2)",
    "muse_spark": "has_post_expert_norm=True",
    "aria": "is_transposed=True without bias",
    "openai_privacy_filter": "is_transposed, has_bias, custom _apply_gate on concatenated halves",
    "deepseek_v4": "custom _apply_gate (clamped SwiGLU)",
    "interleaved_gelu": "is_concatenated=False with the default gate (GELU)",
    "gpt_oss": "is_concatenated=False, is_transposed, has_bias, custom _apply_gate",
    "mixtral": "the default layout (SwiGLU)",
}


# OpenAI's privacy filter's own forward computes in float32 whatever the dtype (on purpose, for
# bfloat16 checkpoints), so in float64 its reference is transformers' batched_mm experts, which
# compute in the tokens' dtype.
REFERENCE = {"openai_privacy_filter": "batched_mm"}


def make_pair(kind, dtype=torch.float64, seed=0):
    """(reference module, tutel module) of the case, with the same random parameters in `dtype`;
    the reference runs the class's own forward (or REFERENCE's implementation)."""
    skip_unless_released(kind)
    config = _config(kind)
    config._experts_implementation = REFERENCE.get(kind, "eager")
    eager = _class(kind)(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in eager.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * 0.5)
    eager = eager.to(dtype)
    ours = copy.deepcopy(eager)
    ours.config = copy.deepcopy(config)
    ours.config._experts_implementation = "tutel"
    return eager, ours


def make_inputs(tokens, k, dtype=torch.float64, seed=1, num_experts=E):
    """hidden_states [T, H], distinct top-k expert ids [T, k] and positive weights [T, k]."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=generator, dtype=torch.float64).to(dtype)
    ids = torch.rand(tokens, num_experts, generator=generator).topk(k, dim=1).indices
    weights = torch.rand(tokens, k, generator=generator, dtype=torch.float64).to(dtype)
    return hidden, ids, weights
