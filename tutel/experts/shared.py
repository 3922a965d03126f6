"""Shared experts: a dense SwiGLU MLP every token goes through beside its routed experts.

DeepSeek-V2/V3, Kimi-K2, GLM-4.5 and Llama 4 add its output to the routed experts' output;
Qwen2-MoE first scales it by ``sigmoid(x . w_g)`` with a learned vector w_g (``gated``).  n shared
experts of hidden size I are one MLP of hidden size n * I, so one ``hidden_size`` describes them.

Selected with ``moe_layer(experts={..., 'shared_experts': {'hidden_size': n * I}})``.  The
parameters are replicated on every process (like the gate's), not expert-parallel:
``shared_experts.gate_proj.weight`` [I, M], ``shared_experts.up_proj.weight`` [I, M],
``shared_experts.down_proj.weight`` [M, I] and, when gated, ``shared_experts.gate.weight`` [1, M]
(nn.Linear layouts, the same as transformers' models).
"""
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F

OPTIONS = ("hidden_size", "gated", "activation_fn")


class SharedExperts(torch.nn.Module):
    """``y = down(act(gate_proj(x)) * up_proj(x))``, times ``sigmoid(gate(x))`` when ``gated``.

    Args:
        model_dim: token feature size M.
        hidden_size: the shared experts' total hidden size.
        gated: scale the output by a learned sigmoid gate (Qwen2-MoE).
        activation_fn: act (default SiLU).
    """

    def __init__(self, model_dim: int, hidden_size: int, gated: bool = False,
                 activation_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.activation_fn = activation_fn
        self.gate_proj = torch.nn.Linear(model_dim, hidden_size, bias=False)
        self.up_proj = torch.nn.Linear(model_dim, hidden_size, bias=False)
        self.down_proj = torch.nn.Linear(hidden_size, model_dim, bias=False)
        self.gate = torch.nn.Linear(model_dim, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, M] -> [T, M]."""
        y = self.down_proj(self.activation_fn(self.gate_proj(x)) * self.up_proj(x))
        if self.gate is not None:
            y = torch.sigmoid(self.gate(x)) * y
        return y


def pop_shared_experts(experts: Dict[str, Any], model_dim: int) -> Optional[SharedExperts]:
    """Removes ``'shared_experts'`` from an experts dict (modified in place) and builds the module
    (None when absent).  Raises ValueError naming the option for a malformed setting."""
    config = experts.pop("shared_experts", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"experts option shared_experts={config!r} is not allowed: use a dict such as "
                         f"{{'hidden_size': 64, 'gated': False}}")
    unknown = [name for name in config if name not in OPTIONS]
    if unknown:
        raise ValueError(f"experts option shared_experts has unknown key(s) {unknown}; allowed: {', '.join(OPTIONS)}")
    hidden_size = config.get("hidden_size")
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"experts option shared_experts['hidden_size']={hidden_size!r} is not allowed: it must "
                         f"be an integer >= 1 (the shared experts' total hidden size)")
    gated = config.get("gated", False)
    if not isinstance(gated, bool):
        raise ValueError(f"experts option shared_experts['gated']={gated!r} is not allowed: True or False")
    output_dim = experts.get("output_dim")
    if output_dim is not None and output_dim != model_dim:
        raise ValueError(f"experts option shared_experts adds a [tokens, model_dim={model_dim}] output to the "
                         f"routed experts', which contradicts output_dim={output_dim}")
    return SharedExperts(model_dim, hidden_size, gated, config.get("activation_fn") or F.silu)
