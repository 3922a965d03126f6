"""Hugging Face transformers MoE blocks built from configs in code (no download), with random
weights, and tutel's counterparts holding the same weights.

Shapes: the families' real proportions (experts, top-k, intermediate / hidden), with the hidden
size scaled to 1024 so that a 2-core machine runs thousands of tokens in seconds; ``full_size``
gives the published models' own layer shapes (for GPUs).
"""
import contextlib
from typing import Callable, Dict, Iterator, NamedTuple, Optional

import torch

# name: (config class, config kwargs, block class path) at full benchmark size
FAMILIES = {
    # Qwen3-30B-A3B: H 2048, moe_intermediate 768, 128 experts, top-8 -> half the width and experts
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=1024, moe_intermediate_size=512, num_experts=64,
                                         num_experts_per_tok=8, norm_topk_prob=True),
                  "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"),
    # Mixtral-8x7B: H 4096, intermediate 14336, 8 experts, top-2 -> a quarter of the width
    "mixtral": ("MixtralConfig", dict(hidden_size=1024, intermediate_size=3584, num_local_experts=8,
                                      num_experts_per_tok=2),
                "mixtral.modeling_mixtral.MixtralSparseMoeBlock"),
    # DeepSeek-V3: H 7168, moe_intermediate 2048, 256 experts in 8 groups, top-8 of 4 groups, 1 shared
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=1024, moe_intermediate_size=256, n_routed_experts=64,
                                             num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                                             norm_topk_prob=True),
                    "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE"),
    # gpt-oss-20b: H 2880, intermediate 2880, 32 experts, top-4, biases, clamped interleaved SwiGLU
    "gpt_oss": ("GptOssConfig", dict(hidden_size=1024, intermediate_size=1024, num_local_experts=32,
                                     num_experts_per_tok=4),
                "gpt_oss.modeling_gpt_oss.GptOssMLP"),
}
# The published models' MoE layers, for a machine that holds them (DeepSeek-V3's is 11 GiB in bf16).
FULL_SIZES = {
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128),  # Qwen3-30B-A3B
    "mixtral": dict(hidden_size=4096, intermediate_size=14336),  # Mixtral-8x7B
    "deepseek_v3": dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256),  # DeepSeek-V3
    "gpt_oss": dict(hidden_size=2880, intermediate_size=2880),  # gpt-oss-20b
}
SMOKE_SIZES = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=16, num_experts=8, n_routed_experts=8,
                   num_local_experts=8, n_group=4, topk_group=2)


class Block(NamedTuple):
    name: str
    module: torch.nn.Module  # the whole transformers block (router, experts, shared experts)
    experts: torch.nn.Module  # its experts module (the part the backends replace)
    router: Callable[[torch.Tensor], tuple]  # x [T, H] -> (top_k_index, top_k_weights)
    config: object


def _import(path: str):
    import importlib
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def _router(block: torch.nn.Module) -> Callable[[torch.Tensor], tuple]:
    gate = getattr(block, "gate", None) or getattr(block, "router")

    def route(x: torch.Tensor):
        _, weights, indices = gate(x)
        return indices, weights
    return route


@contextlib.contextmanager
def built_in(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Modules constructed inside are made directly in `dtype` on `device` (no float32 copy on the
    host first: a full-size DeepSeek-V3 layer would take 45 GiB there)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_block(name: str, dtype: torch.dtype, smoke: bool, seed: int = 0, device: str = "cpu",
                full_size: bool = False, sizes: Optional[Dict[str, int]] = None) -> Block:
    """The family's MoE block with random weights (the routers' too: transformers zero-initialises them),
    on `device`; `full_size` takes the published model's layer shapes (FULL_SIZES) instead of the scaled ones,
    `sizes` the config values given (after the others)."""
    import transformers
    config_name, kwargs, block_path = FAMILIES[name]
    kwargs = dict(kwargs)
    if full_size:
        kwargs.update(FULL_SIZES[name])
    if smoke:
        kwargs.update({key: value for key, value in SMOKE_SIZES.items() if key in kwargs})
    kwargs.update({key: value for key, value in (sizes or {}).items() if key in kwargs})
    config = getattr(transformers, config_name)(**kwargs)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    with built_in(dtype, torch.device(device)):
        block = _import(block_path)(config)
    with torch.no_grad():
        for param_name, param in block.named_parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            std = 0.02 if param.dim() == 1 else fan_in ** -0.5
            if "experts" in param_name and param.dim() == 3 and getattr(block.experts, "is_transposed", False):
                std = param.shape[-2] ** -0.5
            param.normal_(0.0, std)
    block = block.to(dtype)
    return Block(name, block, block.experts, _router(block), config)


def is_standard_swiglu(experts: torch.nn.Module) -> bool:
    """Whether the experts compute silu(gate) * up on [gate | up] halves (transformers' default gate)."""
    from transformers.integrations.moe import _default_apply_gate
    act = getattr(experts, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")
    return (getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", False) and silu
            and type(experts)._apply_gate is _default_apply_gate)


def tutel_backend_name() -> str:
    """The experts implementation tutel registers with transformers (importing the integration registers it)."""
    import tutel.integrations.transformers  # noqa: F401
    return "tutel"


def moe_layer_like(block: Block) -> Optional[torch.nn.Module]:
    """A tutel moe_layer (llama_ffn experts, top-k softmax gate) holding the block's expert weights,
    for the families whose experts are plain SwiGLU without biases; None for the others."""
    experts = block.experts
    if not is_standard_swiglu(experts) or experts.has_bias or experts.is_transposed:
        return None
    from tutel import moe
    num_experts, two_inter, hidden = experts.gate_up_proj.shape
    inter = two_inter // 2
    k = block.config.num_experts_per_tok
    dtype = experts.gate_up_proj.dtype
    with built_in(dtype, experts.gate_up_proj.device):
        layer = moe.moe_layer(gate_type={"type": "top", "k": k, "capacity_factor": 0.0, "fp32_gate": False},
                              model_dim=hidden, experts={"type": "llama_ffn", "num_experts_per_device": num_experts,
                                                         "hidden_size_per_expert": inter}).to(dtype)
    router_weight = getattr(block.module, "gate").weight
    with torch.no_grad():
        gate_w, up_w = experts.gate_up_proj.detach().split(inter, dim=1)  # [E, I, H] each
        layer.experts.W_fc1.copy_(gate_w.transpose(1, 2).reshape(-1))  # [E, H, I]
        layer.experts.W_fc2.copy_(up_w.transpose(1, 2).reshape(-1))
        layer.experts.W_fc3.copy_(experts.down_proj.detach().transpose(1, 2).reshape(-1))  # [E, I, H]
        layer.gates[0].wg.weight.copy_(router_weight.detach().to(dtype))
    return layer


def experts_weight_bytes(experts: torch.nn.Module) -> Dict[str, int]:
    """Bytes of one expert's weights (and biases)."""
    params = [p for name, p in experts.named_parameters()]
    num_experts = params[0].shape[0]
    return {"per_expert": sum(p.numel() * p.element_size() for p in params) // num_experts}


def experts_flops_per_choice(experts: torch.nn.Module) -> int:
    """FLOPs of one (token, expert) pair: the up and down projections' multiply-adds."""
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    return 2 * (up.shape[1] * up.shape[2] + experts.down_proj.shape[1] * experts.down_proj.shape[2])


def case_inputs(block: Block, tokens: int, train: bool) -> tuple:
    """(x, indices, weights, grad) for one case on the block's device: random tokens (seeded by
    `tokens`), the block's own routing of them, and a random output gradient."""
    experts = block.experts
    hidden = experts.down_proj.shape[1 if not experts.is_transposed else 2]
    dtype, device = experts.down_proj.dtype, experts.down_proj.device
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype).to(device).requires_grad_(train)
    with torch.no_grad():
        indices, weights = block.router(x)
    grad = torch.randn(tokens, hidden, generator=generator).to(dtype).to(device)
    return x, indices, weights.detach(), grad


def experts_call(block: Block, backend: str, x, indices, weights, train: bool, grad) -> Callable[[], None]:
    """One call of the block's experts module under experts implementation `backend`: forward
    without autograd, or forward and backward (gradients reset first) when `train`."""
    def run():
        block.config._experts_implementation = backend
        if train:
            for p in block.experts.parameters():
                p.grad = None
            x.grad = None
            y = block.experts(x, indices, weights)
            y.backward(grad)
        else:
            with torch.no_grad():
                block.experts(x, indices, weights)
    return run
