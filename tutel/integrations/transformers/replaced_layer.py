"""The moe_layer that stands in for a transformers sparse-MoE block.

``TransformersRouter`` computes a block's router logits with the same arithmetic as the family's
router (the precision of the logits decides which experts win and the weights' last bits), and
``ReplacedMoeBlock`` is a ``tutel.moe.moe_layer`` that keeps the block's calling convention and
applies per-call switch defaults chosen at replacement time.
"""
from typing import Any, Dict

import torch
import torch.nn.functional as F

from ...impls.call_settings import validate_switches
from ...impls.moe_layer import MOELayer

# logits modes: 'model' -> x W^T (+ b) in the model's dtype (gpt-oss); 'float32_logits' -> the same,
# then cast to float32 (Mixtral, Qwen, OLMoE, Llama 4 take softmax / sigmoid in float32);
# 'float32_inputs' -> x and W cast to float32 before the product (DeepSeek-V3, GLM-4.5).
LOGITS_MODES = ("model", "float32_logits", "float32_inputs")

# forward()'s per-call switches that replace_moe_blocks accepts as defaults.
CALL_SWITCHES = ("capacity_factor", "top_k", "a2a_ffn_overlap_degree", "adaptive_r", "megablocks_size")


class TransformersRouter(torch.nn.Module):
    """A linear router ``wg`` [E, model_dim] (with ``router_bias``, a bias [E]) whose logits follow
    one of ``LOGITS_MODES``.  Used as a 'custom' gate: the layer's scored-routing options do the rest."""

    def __init__(self, model_dim: int, num_global_experts: int, k: int = 1, router_bias: bool = False,
                 logits: str = "model", **options):
        super().__init__()
        if logits not in LOGITS_MODES:
            raise ValueError(f"TransformersRouter: logits={logits!r} is not allowed; allowed: {LOGITS_MODES}")
        self.logits = logits
        self.wg = torch.nn.Linear(model_dim, num_global_experts, bias=bool(router_bias))
        self.top_k = int(k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, model_dim] -> logits [T, E]."""
        weight, bias = self.wg.weight, self.wg.bias
        if self.logits == "float32_inputs":
            logits = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        else:
            logits = F.linear(x.to(weight.dtype), weight, bias)
            if self.logits == "float32_logits":
                logits = logits.float()
        return logits


class ReplacedMoeBlock(MOELayer):
    """A ``moe_layer`` replacing a transformers sparse-MoE block.

    ``forward(hidden_states, **switches)`` takes every per-call switch of ``moe_layer.forward``;
    those not given take the defaults passed to ``replace_moe_blocks``.  Blocks that returned a
    tuple keep doing so: gpt-oss's ``(hidden, routing weights [T, k])`` and Llama 4's
    ``(hidden, router logits [T, E])`` (float32).  ``l_aux`` holds the last call's auxiliary loss.

    Args:
        call_defaults: per-call switch defaults (names from ``CALL_SWITCHES``).
        returns: 'hidden', 'hidden_and_weights' or 'hidden_and_logits'.
        family: the transformers family the block came from (for repr and messages).
        **layer_args: ``moe_layer`` arguments.
    """

    def __init__(self, *, call_defaults: Dict[str, Any], returns: str, family: str, **layer_args):
        super().__init__(**layer_args)
        self.call_defaults = dict(call_defaults)
        self.returns = returns
        self.family = family

    def check_switches(self, switches: Dict[str, Any], where: str) -> None:
        """Raises ValueError / TypeError naming the switch when `switches` (names from
        ``CALL_SWITCHES``) contain a value this layer's forward would refuse."""
        for gate_index in range(len(self.gates)):
            validate_switches(self, where=where, gate_index=gate_index, **switches)

    def extra_repr(self) -> str:
        return f"family={self.family}, " + super().extra_repr()

    def forward(self, input: torch.Tensor, **switches):
        settings = dict(self.call_defaults)
        settings.update(switches)
        output, result = self.forward_with_result(input, **settings)
        if self.returns == "hidden":
            return output
        if self.returns == "hidden_and_weights":  # the j-th choice of every token in column j
            return output, torch.stack(list(result.weights), dim=1)
        return output, result.logits
