"""One moe_layer call's switches: validated once, resolved against the layer's and the gate's defaults.

``resolve_call`` is what ``MOELayer.forward`` runs before anything else; ``validate_switches``
checks switches without an input (e.g. defaults stored for later calls).  Nothing after them
checks the same values again (the C++ operators keep their own checks as the last guard for
direct operator calls).
"""
import dataclasses
import math
from typing import Any, Optional

import torch

from ..gates.scoring import check_top_k
from ..ops.checks import require_finite_number, require_int, require_tensor, require_top_k
from ..rules.capacity import capacity_alignment, expert_capacity

SWITCHES = ("gate_index", "capacity_factor", "top_k", "a2a_ffn_overlap_degree", "adaptive_r", "megablocks_size")


@dataclasses.dataclass(frozen=True)
class CallSettings:
    """One forward call's resolved switches (the call's arguments, or the layer's / gate's defaults)."""

    gate: torch.nn.Module
    top_k: int
    capacity_factor: float
    overlap: int          # a2a_ffn_overlap_degree
    adaptive_r: int
    megablocks_size: int  # 0 when the grouped path is off (or cannot run on several processes)
    alignment: int = 1    # the multiple the capacity rounds up to (tutel.rules.capacity.capacity_alignment)
    # capacity_factor > 0: the capacity of the call's token count (None when the count is not given)
    static_capacity: Optional[int] = None


def resolve_switches(layer, where: str, gate_index: int = 0, capacity_factor: Optional[float] = None,
                     top_k: Optional[int] = None, a2a_ffn_overlap_degree: Optional[int] = None,
                     adaptive_r: Optional[int] = None, megablocks_size: int = 0,
                     tokens: Optional[int] = None) -> CallSettings:
    """Validates the per-call switches of `layer` (a MOELayer) and fills in the defaults.

    `tokens` (the call's token count) enables the check that needs it (the overlap degree against
    a static capacity); without it that check is left to the call."""
    gate_index = require_int(gate_index, "gate_index", where, minimum=0)
    if gate_index >= len(layer.gates):
        raise ValueError(f"{where}: gate_index={gate_index} is out of range; the layer has "
                         f"{len(layer.gates)} gate(s) (allowed: 0..{len(layer.gates) - 1})")
    gate = layer.gates[gate_index]
    num_experts = layer.num_global_experts
    if top_k is None:
        top_k = gate.top_k
    else:
        top_k = require_top_k(top_k, num_experts, where)
        options = getattr(gate, "routing_options", None)
        if options is not None:
            check_top_k(options, top_k, num_experts, where)
    capacity_factor = require_finite_number(gate.capacity_factor if capacity_factor is None else capacity_factor,
                                            "capacity_factor", where)
    overlap = layer.a2a_ffn_overlap_degree if a2a_ffn_overlap_degree is None else \
        require_int(a2a_ffn_overlap_degree, "a2a_ffn_overlap_degree", where, minimum=1)
    if adaptive_r is None:
        adaptive_r = layer.adaptive_degree
    else:
        adaptive_r = require_int(adaptive_r, "adaptive_r", where, minimum=0)
        if adaptive_r not in layer.valid_rs:
            raise ValueError(f"{where}: adaptive_r={adaptive_r} is not valid for {layer.sharded_count} "
                             f"process(es) per expert; allowed: {layer.valid_rs}")
    if overlap > 1 and capacity_factor > 0 and tokens is not None:
        static_capacity = expert_capacity(capacity_factor, top_k, tokens, num_experts)
        if 0 < static_capacity < overlap:
            raise ValueError(f"{where}: a2a_ffn_overlap_degree={overlap} exceeds this call's capacity of "
                             f"{static_capacity} slots per expert: the extra chunks would hold only padding; "
                             f"allowed: 1 <= a2a_ffn_overlap_degree <= {static_capacity}")
    megablocks_size = require_int(megablocks_size, "megablocks_size", where, minimum=0)
    if megablocks_size > 0 and layer.world_size > 1:
        megablocks_size = 0  # the grouped path needs every expert's load on this process
    alignment = capacity_alignment(layer.sharded_count, overlap, megablocks_size)
    static_capacity = None
    if capacity_factor > 0 and tokens is not None:
        static_capacity = expert_capacity(capacity_factor, top_k, tokens, num_experts, alignment=alignment)
    return CallSettings(gate, top_k, capacity_factor, overlap, adaptive_r, megablocks_size, alignment, static_capacity)


def require_layer_input(layer, input: Any, reserve_dims: Any, where: str) -> int:
    """Checks a call's `input` against the layer (a floating tensor of >= 2 dims whose last
    `reserve_dims` dims hold model_dim features); returns reserve_dims as an int."""
    require_tensor(input, "input", where)
    if not input.is_floating_point():
        raise TypeError(f"{where}: `input` must be a floating-point tensor, got {input.dtype}")
    if input.dim() < 2:
        raise ValueError(f"{where}: `input` must have at least 2 dims (tokens, ..., model_dim), "
                         f"got shape {tuple(input.shape)}")
    reserve_dims = require_int(reserve_dims, "reserve_dims", where, minimum=1)
    if reserve_dims >= input.dim():
        raise ValueError(f"{where}: reserve_dims={reserve_dims} is too large for a {input.dim()}-D input; "
                         f"allowed: 1 <= reserve_dims <= {input.dim() - 1}")
    features = math.prod(input.shape[-reserve_dims:])
    if features != layer.model_dim:
        raise ValueError(f"{where}: the last {reserve_dims} dim(s) of `input` {tuple(input.shape)} hold "
                         f"{features} features but the layer's model_dim is {layer.model_dim}")
    return reserve_dims


def validate_switches(layer, *, where: str = "moe_layer.forward", **switches: Any) -> CallSettings:
    """Checks per-call switches of `layer` (a ``moe_layer``) without calling it: the same rules and
    messages as ``layer(x, **switches)``.  Returns the resolved settings.

    Args:
        layer: the MoE layer.
        where: the name the messages start with.
        **switches: any of gate_index, capacity_factor, top_k, a2a_ffn_overlap_degree, adaptive_r,
            megablocks_size.

    Raises:
        TypeError / ValueError naming the switch; TypeError for a name that is not a switch.
    """
    unknown = sorted(set(switches) - set(SWITCHES))
    if unknown:
        raise TypeError(f"{where}: {', '.join(map(repr, unknown))} is not a per-call switch; "
                        f"allowed: {', '.join(SWITCHES)}")
    return resolve_switches(layer, where, **switches)
