"""Tiny random float64 causal LMs of the families replace_moe_blocks supports, and the checks that
a replaced model computes what the original computed (used by test_replace_moe_blocks.py and by
the two-process checks in tests/python/distributed/dist_checks_replace.py)."""
import copy
import os
import sys
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_transformers_models as tiny  # noqa: E402

# tiny_transformers_models' families that replace_moe_blocks supports, plus Llama 4 built here.
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4"]
# Families whose expert count (8 or 6) two processes can split.
EVEN_FAMILIES = ["qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "llama4"]
LLAMA4 = dict(intermediate_size=10, intermediate_size_mlp=16, num_local_experts=6, num_experts_per_tok=2,
              interleave_moe_layer_step=1, head_dim=12, attention_chunk_size=64, no_rope_layers=[1, 1])


def build(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """The family's tiny float64 causal LM, every parameter (and router bias buffer) random, in eval mode."""
    if family != "llama4":
        return tiny.build(family, seed=seed, **overrides)
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    config = Llama4TextConfig(**{**tiny.COMMON, **LLAMA4, **overrides})
    return tiny.randomise(Llama4ForCausalLM(config).double(), seed).eval()


def tokens(seed: int, batch: int = 2, length: int = 9) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, tiny.VOCAB, (batch, length), generator=generator)


def block_names(model: torch.nn.Module) -> List[str]:
    from tutel.integrations.transformers.replace import find_moe_blocks
    return [name for name, _ in find_moe_blocks(model)]


def outside_blocks(model: torch.nn.Module, blocks: List[str]) -> Dict[str, torch.nn.Parameter]:
    """The parameters of `model` that belong to no MoE block."""
    return {name: param for name, param in model.named_parameters()
            if not any(name.startswith(block + ".") for block in blocks)}


def logits_and_grads(model: torch.nn.Module, ids: torch.Tensor, blocks: List[str]) -> Tuple[torch.Tensor, Dict]:
    """Logits for `ids` and the gradients of <logits, fixed random upstream> for the parameters
    outside the MoE blocks."""
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    upstream = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7), dtype=logits.dtype)
    (logits * upstream).sum().backward()
    grads = {name: param.grad.clone() for name, param in outside_blocks(model, blocks).items()
             if param.grad is not None}
    return logits.detach(), grads


def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int = 6) -> torch.Tensor:
    """Greedy continuation of exactly `new_tokens` tokens (no early stop, so every process of an
    expert-parallel group runs the same number of steps)."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)


def original_and_copy(family: str, seed: int = 0) -> Tuple[torch.nn.Module, torch.nn.Module, List[str]]:
    """(model to replace, untouched deep copy, names of its MoE blocks)."""
    model = build(family, seed)
    return model, copy.deepcopy(model), block_names(model)


def expert_grads_as_layer(experts: torch.nn.Module, family: str, rank: int = 0,
                          world: int = 1) -> Dict[str, torch.Tensor]:
    """A transformers experts module's gradients (experts rank*E/world .. of them) in the layout of
    the tutel experts that replace it: clamped_swiglu keeps gpt-oss's names and layout; llama_ffn
    stores flat W_fc1 / W_fc2 [L, M, I] and W_fc3 [L, I, M]."""
    def local(grad):
        count = grad.shape[0] // world
        return grad[rank * count:(rank + 1) * count]
    if family == "gpt_oss":
        return {name: local(getattr(experts, name).grad) for name in
                ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    up, down = local(experts.gate_up_proj.grad), local(experts.down_proj.grad)
    if family == "llama4":  # [L, M, 2I] and [L, I, M]
        inner = down.shape[1]
        wanted = (up[..., :inner], up[..., inner:], down)
    else:  # [L, 2I, M] and [L, M, I]
        inner = down.shape[2]
        wanted = (up[:, :inner].transpose(1, 2), up[:, inner:].transpose(1, 2), down.transpose(1, 2))
    return {name: grad.reshape(-1) for name, grad in zip(("W_fc1", "W_fc2", "W_fc3"), wanted)}
