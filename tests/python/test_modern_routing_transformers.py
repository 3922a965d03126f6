"""Scored routing and the new experts against transformers' own MoE blocks (DeepSeek-V3, GLM-4.5,
Qwen3-MoE, Qwen2-MoE, gpt-oss, Llama 4, and Mixtral with Tutel's default routing): the same weights and tokens in, the same chosen experts, weights,
outputs and input gradients out.  Every parameter is randomised first (transformers initialises
routers and biases to zero).  The routers of DeepSeek-V3, the Qwen families and Llama 4 compute in
float32 (Mixtral's softmax too), so there values agree to float32 precision; gpt-oss's to float64
precision."""
import torch
from transformers.models.deepseek_v3 import configuration_deepseek_v3, modeling_deepseek_v3
from transformers.models.glm4_moe import configuration_glm4_moe, modeling_glm4_moe
from transformers.models.gpt_oss import configuration_gpt_oss, modeling_gpt_oss
from transformers.models.llama4 import configuration_llama4, modeling_llama4
from transformers.models.mixtral import configuration_mixtral, modeling_mixtral
from transformers.models.qwen2_moe import configuration_qwen2_moe, modeling_qwen2_moe
from transformers.models.qwen3_moe import configuration_qwen3_moe, modeling_qwen3_moe

from tutel import moe

HIDDEN, INTERMEDIATE = 6, 5
FLOAT32_ROUTER = dict(rtol=2e-6, atol=2e-6)


def randomize(module):
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor) * 0.5)
    return module.double()


def tutel_layer(gate, experts, num_experts, **kwargs):
    experts = dict(experts, num_experts_per_device=num_experts)
    return moe.moe_layer(gate_type=dict(gate, capacity_factor=0.0), model_dim=HIDDEN, experts=experts,
                         **kwargs).double()


def load_llama_ffn(layer, gate_w, up_w, down_w):
    """llama_ffn's flat W_fc1 / W_fc2 [L, M, I] and W_fc3 [L, I, M] from per-expert [L, M, I] / [L, I, M]."""
    with torch.no_grad():
        for name, value in (("W_fc1", gate_w), ("W_fc2", up_w), ("W_fc3", down_w)):
            getattr(layer.experts, name).copy_(value.reshape(-1))


def load_concatenated_experts(layer, experts):
    """transformers' gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    load_llama_ffn(layer, gate_up[:, :INTERMEDIATE].transpose(1, 2), gate_up[:, INTERMEDIATE:].transpose(1, 2),
                   down.transpose(1, 2))


def capture_routing(monkeypatch):
    """Records (expert ids [T, k], weights [T, k]) of the next scored-routing calls of any layer."""
    from tutel.impls import layer_routing
    records = []
    original = layer_routing.route_scored

    def recording(*args, **kwargs):
        crit, l_aux = original(*args, **kwargs)
        records.append((torch.stack(crit.indices_s, 1).long(), torch.stack(crit.gates_s, 1)))
        return crit, l_aux
    monkeypatch.setattr(layer_routing, "route_scored", recording)
    return records


def same_choices(ids, weights, expected_ids, expected_weights, **tolerance):
    """Compares two routings whatever order each lists a token's k choices in."""
    order, expected_order = ids.sort(dim=1), expected_ids.sort(dim=1)
    assert torch.equal(order.values, expected_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices).double(),
                               expected_weights.gather(1, expected_order.indices).double(), **tolerance)


def compare_blocks(block, layer, x, **tolerance):
    """Output and input gradient of a transformers MoE block and of the tutel layer on x."""
    x_block, x_layer = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = block(x_block)
    expected = expected[0] if isinstance(expected, tuple) else expected
    expected = expected.reshape(x.shape)
    y = layer(x_layer)
    upstream = torch.randn_like(y)
    (expected * upstream).sum().backward()
    (y * upstream).sum().backward()
    torch.testing.assert_close(y, expected, **tolerance)
    torch.testing.assert_close(x_layer.grad, x_block.grad, **tolerance)


def test_deepseek_v3_block(monkeypatch):
    config = configuration_deepseek_v3.DeepseekV3Config(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, n_routed_experts=12, num_experts_per_tok=3,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=2)
    block = randomize(modeling_deepseek_v3.DeepseekV3MoE(config))
    layer = tutel_layer({"type": "top", "k": 3, "score_function": "sigmoid", "selection_bias": True, "n_group": 4,
                         "topk_group": 2, "routed_scaling_factor": 2.5, "renormalize": True},
                        {"type": "llama_ffn", "hidden_size_per_expert": INTERMEDIATE,
                         "shared_experts": {"hidden_size": 2 * INTERMEDIATE}}, 12)
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(block.gate.weight)
        layer.gates[0].selection_bias.bias.copy_(block.gate.e_score_correction_bias)
    load_concatenated_experts(layer, block.experts)
    layer.shared_experts.load_state_dict(block.shared_experts.state_dict())
    x = torch.randn(3, 7, HIDDEN, dtype=torch.float64)
    records = capture_routing(monkeypatch)
    compare_blocks(block, layer, x, **FLOAT32_ROUTER)
    _, expected_weights, expected_ids = block.gate(x)
    same_choices(*records[0], expected_ids, expected_weights, **FLOAT32_ROUTER)


def test_glm4_moe_block():
    config = configuration_glm4_moe.Glm4MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, n_routed_experts=12, num_experts_per_tok=4,
        n_group=3, topk_group=2, routed_scaling_factor=1.8, norm_topk_prob=True, n_shared_experts=1)
    block = randomize(modeling_glm4_moe.Glm4MoeMoE(config))
    layer = tutel_layer({"type": "top", "k": 4, "score_function": "sigmoid", "selection_bias": True, "n_group": 3,
                         "topk_group": 2, "routed_scaling_factor": 1.8, "renormalize": True},
                        {"type": "llama_ffn", "hidden_size_per_expert": INTERMEDIATE,
                         "shared_experts": {"hidden_size": INTERMEDIATE}}, 12)
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(block.gate.weight)
        layer.gates[0].selection_bias.bias.copy_(block.gate.e_score_correction_bias)
    load_concatenated_experts(layer, block.experts)
    layer.shared_experts.load_state_dict(block.shared_experts.state_dict())
    compare_blocks(block, layer, torch.randn(2, 7, HIDDEN, dtype=torch.float64), **FLOAT32_ROUTER)


def test_mixtral_block_with_tutels_default_routing():
    config = configuration_mixtral.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                                 num_local_experts=7, num_experts_per_tok=2)
    block = randomize(modeling_mixtral.MixtralSparseMoeBlock(config)).eval()
    layer = tutel_layer({"type": "top", "k": 2}, {"type": "llama_ffn", "hidden_size_per_expert": INTERMEDIATE}, 7)
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(block.gate.weight)
    load_concatenated_experts(layer, block.experts)
    compare_blocks(block, layer, torch.randn(2, 9, HIDDEN, dtype=torch.float64), **FLOAT32_ROUTER)


def test_qwen3_moe_block_and_its_balance_loss(monkeypatch):
    config = configuration_qwen3_moe.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                                    num_experts=9, num_experts_per_tok=4, norm_topk_prob=True)
    block = randomize(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config))
    layer = tutel_layer({"type": "top", "k": 4, "balance_loss": "global_batch"},
                        {"type": "llama_ffn", "hidden_size_per_expert": INTERMEDIATE}, 9)
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(block.gate.weight)
    load_concatenated_experts(layer, block.experts)
    x = torch.randn(2, 11, HIDDEN, dtype=torch.float64)
    records = capture_routing(monkeypatch)
    compare_blocks(block, layer, x, **FLOAT32_ROUTER)
    logits, expected_weights, expected_ids = block.gate(x)
    same_choices(*records[0], expected_ids, expected_weights, **FLOAT32_ROUTER)
    expected_loss = modeling_qwen3_moe.load_balancing_loss_func((logits,), 9, 4)
    torch.testing.assert_close(layer(x).l_aux.float(), expected_loss.float(), rtol=1e-6, atol=1e-6)


def test_qwen2_moe_block_with_gated_shared_expert():
    config = configuration_qwen2_moe.Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                                    num_experts=9, num_experts_per_tok=3,
                                                    shared_expert_intermediate_size=7, norm_topk_prob=False)
    block = randomize(modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config))
    layer = tutel_layer({"type": "top", "k": 3, "renormalize": False},
                        {"type": "llama_ffn", "hidden_size_per_expert": INTERMEDIATE,
                         "shared_experts": {"hidden_size": 7, "gated": True}}, 9)
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(block.gate.weight)
        layer.shared_experts.gate.weight.copy_(block.shared_expert_gate.weight)
    load_concatenated_experts(layer, block.experts)
    layer.shared_experts.load_state_dict(block.shared_expert.state_dict(), strict=False)
    compare_blocks(block, layer, torch.randn(2, 9, HIDDEN, dtype=torch.float64), **FLOAT32_ROUTER)


def test_gpt_oss_block(monkeypatch):
    config = configuration_gpt_oss.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                                num_local_experts=9, num_experts_per_tok=3)
    block = randomize(modeling_gpt_oss.GptOssMLP(config))
    with torch.no_grad():  # large enough values that the clamp at 7 acts on both sides
        block.experts.gate_up_proj.mul_(8)
    layer = tutel_layer({"type": "top", "k": 3, "router_bias": True, "softmax_after_topk": True},
                        {"type": "clamped_swiglu", "hidden_size_per_expert": INTERMEDIATE}, 9)
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(block.router.weight)
        layer.gates[0].wg.bias.copy_(block.router.bias)
    layer.experts.load_state_dict(block.experts.state_dict())
    x = torch.randn(2, 8, HIDDEN, dtype=torch.float64)
    records = capture_routing(monkeypatch)
    compare_blocks(block, layer, x, rtol=1e-10, atol=1e-10)
    _, expected_weights, expected_ids = block.router(x.reshape(-1, HIDDEN))
    same_choices(*records[0], expected_ids, expected_weights, rtol=1e-12, atol=1e-12)
    gate_up = x.reshape(-1, HIDDEN) @ block.experts.gate_up_proj.detach()[0]
    assert (gate_up > 7).any() and (gate_up < -7).any()


def test_llama4_block_scores_before_the_expert():
    config = configuration_llama4.Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                                   num_local_experts=5, num_experts_per_tok=1)
    block = randomize(modeling_llama4.Llama4TextMoe(config))
    layer = tutel_layer({"type": "top", "k": 1, "score_function": "sigmoid", "balance_loss": "none"},
                        {"type": "llama_ffn", "hidden_size_per_expert": INTERMEDIATE,
                         "shared_experts": {"hidden_size": INTERMEDIATE}}, 5, is_postscore=False)
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(block.router.weight)
    gate_up = block.experts.gate_up_proj.detach()
    load_llama_ffn(layer, gate_up[..., :INTERMEDIATE], gate_up[..., INTERMEDIATE:], block.experts.down_proj.detach())
    layer.shared_experts.load_state_dict(block.shared_expert.state_dict())
    # Llama 4 takes the sigmoid in float32
    compare_blocks(block, layer, torch.randn(2, 6, HIDDEN, dtype=torch.float64), **FLOAT32_ROUTER)
