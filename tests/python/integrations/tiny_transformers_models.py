"""Tiny random transformers MoE language models, one per family, built from a config here (no
download).  Every parameter is drawn at random (transformers zero-initialises some routers,
router biases and expert biases, which would hide mistakes), and so are the routers'
load-balancing bias buffers."""
import torch

from transformers_test_setup import skip_unless_released

VOCAB = 67
COMMON = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# family -> (config class name in transformers, options); sizes odd where the family allows, top-k 2..3
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=10, num_local_experts=5, num_experts_per_tok=2, head_dim=12,
                                      router_jitter_noise=0.0)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=16, moe_intermediate_size=10,
                                         shared_expert_intermediate_size=12, num_experts=6, num_experts_per_tok=3,
                                         norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=16, moe_intermediate_size=10, num_experts=7,
                                         num_experts_per_tok=3, norm_topk_prob=True, head_dim=12)),
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=16, moe_intermediate_size=10, n_routed_experts=8,
                                             num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                                             first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=12,
                                             qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=6,
                                             routed_scaling_factor=2.5, num_key_value_heads=2)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=10, num_local_experts=5, num_experts_per_tok=2, head_dim=12,
                                     sliding_window=8, swiglu_limit=1.5,
                                     rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=10, num_experts=6, num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeConfig", dict(intermediate_size=16, moe_intermediate_size=10, n_routed_experts=8,
                                       num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1,
                                       first_k_dense_replace=1, use_qk_norm=True)),
    "phimoe": ("PhimoeConfig", dict(intermediate_size=10, num_local_experts=4, num_experts_per_tok=2,
                                    router_jitter_noise=0.0, input_jitter_noise=0.0)),
    "granitemoe": ("GraniteMoeConfig", dict(intermediate_size=10, num_local_experts=5, num_experts_per_tok=2)),
    # more families of transformers 5.x, in their default layout (concatenated SwiGLU)
    "afmoe": ("AfmoeConfig", dict(intermediate_size=16, moe_intermediate_size=10, num_experts=6, num_experts_per_tok=2,
                                  head_dim=12, num_dense_layers=1)),
    "cohere2_moe": ("Cohere2MoeConfig", dict(intermediate_size=10, num_experts=5, num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2Config", dict(intermediate_size=16, moe_intermediate_size=10, n_routed_experts=6,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6,
                                             qk_nope_head_dim=6, num_key_value_heads=2, n_group=3, topk_group=2,
                                             topk_method="group_limited_greedy")),
    "dots1": ("Dots1Config", dict(intermediate_size=16, moe_intermediate_size=10, n_routed_experts=6,
                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                  topk_group=1, head_dim=12)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(intermediate_size=16, moe_intermediate_size=10, moe_num_experts=6,
                                                moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0)),
    "exaone_moe": ("ExaoneMoeConfig", dict(intermediate_size=16, moe_intermediate_size=10, num_experts=6,
                                           num_experts_per_tok=2, head_dim=12)),
    "flex_olmo": ("FlexOlmoConfig", dict(intermediate_size=10, num_experts=5, num_experts_per_tok=2)),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(intermediate_size=10, num_local_experts=5,
                                                        num_experts_per_tok=2, shared_intermediate_size=12)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(intermediate_size=10, num_experts=5, moe_topk=2, head_dim=12)),
    "jamba": ("JambaConfig", dict(intermediate_size=10, num_experts=5, num_experts_per_tok=2, attn_layer_period=1,
                                  attn_layer_offset=0, expert_layer_period=1, expert_layer_offset=0)),
    "minimax": ("MiniMaxConfig", dict(intermediate_size=10, num_local_experts=5, num_experts_per_tok=2, head_dim=12,
                                      layer_types=["full_attention", "full_attention"])),
    "qwen3_next": ("Qwen3NextConfig", dict(intermediate_size=16, moe_intermediate_size=10,
                                           shared_expert_intermediate_size=12, num_experts=6, num_experts_per_tok=2,
                                           head_dim=12, layer_types=["full_attention", "full_attention"])),
    "solar_open": ("SolarOpenConfig", dict(intermediate_size=16, moe_intermediate_size=10, n_routed_experts=6,
                                           num_experts_per_tok=2, head_dim=12)),
}


# Releases before 5.13 fail in transformers' own code on three of these configs, eager experts
# included: DeepSeek-V2's group_limited_greedy routing reads an attribute its block lacks, and Qwen3-Next
# and Jamba without a linear-attention / Mamba layer ask the cache for a state it does not hold.  There
# these families run with the options below (greedy routing; no cache), the experts unchanged.
BEFORE_5_13 = {"deepseek_v2": dict(topk_method="greedy"), "qwen3_next": dict(use_cache=False),
               "jamba": dict(use_cache=False)}


def randomise(model: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> torch.nn.Module:
    """Every parameter ~ N(0, scale^2) and every router bias buffer as well (in place)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * scale)
        for name, buffer in model.named_buffers():
            if "correction_bias" in name:
                buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=torch.float64) * scale)
    return model


def config(family: str, **overrides):
    """The family's tiny config (``overrides`` replace its options); skips the test where the
    installed transformers lacks the family."""
    import transformers
    from packaging.version import Version
    skip_unless_released(family)
    class_name, options = FAMILIES[family]
    if Version(transformers.__version__) < Version("5.13.0"):
        options = {**options, **BEFORE_5_13.get(family, {})}
    return getattr(transformers, class_name)(**{**COMMON, **options, **overrides})


def build(family: str, dtype: torch.dtype = torch.float64, experts_implementation: str = "eager", seed: int = 0,
          **overrides) -> torch.nn.Module:
    """A tiny randomised causal LM of `family` in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(config(family, **overrides), dtype=dtype,
                                             experts_implementation=experts_implementation)
    return randomise(model, seed).eval()
