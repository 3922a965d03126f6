"""Options every gate accepts besides its own constructor arguments, and the gate dict's k."""
import warnings
from typing import Dict

from ..ops.checks import require_int

# Per-gate routing options stored on the gate object (read by the MoE layer).
ROUTING_OPTIONS = ("capacity_factor", "gate_noise")

# Arguments users sometimes put in the gate dict although they belong to moe_layer(...).
LAYER_ARGUMENTS = ("batch_prioritized_routing", "is_gshard_loss", "normalize_gate", "is_postscore",
                   "a2a_ffn_overlap_degree", "parallel_type", "use_2dh", "seeds", "group")


def check_routing_options(options: Dict, gate_name: str) -> None:
    """Raises for any option a built-in gate does not understand, with a hint where it belongs."""
    for name in options:
        if name in ROUTING_OPTIONS:
            continue
        if name in LAYER_ARGUMENTS:
            raise ValueError(f"Unrecognized argument provided to Gating module: {name} — `{name}` is an "
                             f"argument of moe_layer(...), not of the gate dict")
        raise ValueError(f"Unrecognized argument provided to Gating module: {name} (gate '{gate_name}' "
                         f"accepts k, fp32_gate, {', '.join(ROUTING_OPTIONS)}, its own arguments and the "
                         f"scored-routing options of docs/routing.md)")


def clamp_top_k(k, num_global_experts: int) -> int:
    """The gate dict's k: an integer >= 1, checked as forward's top_k is (same messages); a k above
    the expert count is reduced to it, as Tutel does (Tutel scripts rely on it, e.g. ``--top 2``
    with one expert), with a warning naming both numbers."""
    k = require_int(k, "k", "gate_type", minimum=1)
    if k > num_global_experts:
        warnings.warn(f"gate_type: k={k} exceeds num_global_experts={num_global_experts} (allowed: 1 <= k <= "
                      f"{num_global_experts}); the gate uses k={num_global_experts}, as Tutel does. A per-call "
                      f"top_k above the expert count raises instead.", UserWarning, stacklevel=4)
        return num_global_experts
    return k
