"""Options every gate accepts besides its own constructor arguments."""
from typing import Dict

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
    """Tutel's rule for the gate's k: an integer >= 1, reduced to the expert count."""
    if isinstance(k, bool) or not isinstance(k, (int, float)) or int(k) != k or int(k) < 1:
        raise ValueError(f"gate option k={k!r} is not allowed: k must be an integer >= 1")
    return min(num_global_experts, int(k))
