"""Built-in experts, selected in ``moe_layer(experts={'type': <module name>, ...})``.

Each module exposes ``ExpertModule``: a torch.nn.Module built with
``model_dim``, ``num_experts_per_device`` (experts held by this process),
``sharded_count`` (processes sharing one expert) and its own options, and
called as ``forward(x [local_experts, tokens, *features], ctx)`` where ``ctx``
is the MoE layer (it exposes ``sharded_count``, ``adaptive_degree``, ``group``,
``num_global_experts``, ``model_dim``, ``megablocks_size``, ``dispatch_count``).
"""
from ._grouped import run_grouped_experts, supports_grouped
from .clamped_swiglu import ClampedSwiGLUExperts
from .ffn import FusedExpertsNetwork
from .llama_ffn import LlamaFFNNetwork
from .routed import routed_experts
from .shared import SharedExperts

__all__ = ["ClampedSwiGLUExperts", "FusedExpertsNetwork", "LlamaFFNNetwork", "SharedExperts", "routed_experts",
           "run_grouped_experts", "supports_grouped"]
