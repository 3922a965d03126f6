"""What a moe_layer call decides before it routes (its checks, resolved switches, compute dtype and
path), kept for the next inference call like it.

A decoding step calls every layer with the same shapes and switches, step after step, and those
decisions depend only on them, on the layer's and its gate's settings and on a few global states.
So an inference call (tutel.paths.settled) looks its plan up by a key made of all of these, read
directly from the objects; anything else (training, a new shape, a changed setting, a replaced
module, another backend) makes and checks a plan as every call did before.

Read once per experts module (the key holds the module's class and identity, not what it
offers): whether it offers gated weights, grouped products or a grouped forward.  Built-in
experts fix these when they are built; a custom experts module that changes them between calls
must be replaced instead.
"""
from typing import Any, Dict, NamedTuple, Optional

import torch

from ..paths.settled import settled_state
from ..rules.paths import PathChoice
from .call_settings import CallSettings, require_layer_input, resolve_switches
from .layer_paths import choose_layer_path

_WHERE = "moe_layer.forward"
# Plans kept per layer at most: a prefill of ever-new token counts makes a plan per count.
MAX_PLANS = 256


class CallPlan(NamedTuple):
    """A call's decisions: its token dims, resolved switches, compute dtype and path."""

    reserve_dims: int
    call: CallSettings
    dtype: torch.dtype
    choice: PathChoice


class KeptPlans(dict):
    """A layer's plans by key.  Copies and pickles of the layer start empty: a key holds object
    ids, which mean nothing in another process and other objects in a copy."""

    def __reduce__(self):
        return KeptPlans, ()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "KeptPlans":
        return KeptPlans()


_PLANS = "_tutel_call_plans"


def plan_call(layer, input: torch.Tensor, gate_index: Any, capacity_factor: Any, top_k: Any, overlap: Any,
              reserve_dims: Any, adaptive_r: Any, megablocks_size: Any) -> CallPlan:
    """The plan of a call of moe_layer `layer` on `input` with forward's switches (the kept one
    where the call is an inference call like an earlier one).  Raises forward's errors."""
    key = None
    state = settled_state()
    if state is not None and isinstance(input, torch.Tensor) and type(gate_index) is int and \
            0 <= gate_index < len(layer.gates):
        gate = layer.gates[gate_index]
        experts = layer.experts
        dtype = layer._compute_dtype(input, stacklevel=5)
        key = (state, input.shape, input.dtype, input.device, type(input), dtype,
               gate_index, capacity_factor, top_k, overlap, reserve_dims, adaptive_r, megablocks_size,
               # the layer's and the gate's settings the checks and the facts read
               layer.training, layer.model_dim, layer.world_size, layer.sharded_count, layer.is_gshard_loss,
               layer.is_postscore, layer.a2a_ffn_overlap_degree, layer.adaptive_degree, layer.num_global_experts,
               gate, gate.top_k, gate.capacity_factor, gate.gate_noise, getattr(gate, "routing_options", None),
               type(experts), id(experts))
        plans = layer.__dict__.get(_PLANS)
        try:
            plan = None if plans is None else plans.get(key)
        except TypeError:  # an unhashable switch (the checks below name it)
            key = plan = None
        if plan is not None:
            return plan
    plan = _decide(layer, input, gate_index, capacity_factor, top_k, overlap, reserve_dims, adaptive_r,
                   megablocks_size, None if key is None else dtype)
    if key is not None:
        plans = layer.__dict__.get(_PLANS)
        if plans is None or len(plans) >= MAX_PLANS:
            plans = layer.__dict__[_PLANS] = KeptPlans()
        plans[key] = plan
    return plan


def _decide(layer, input: torch.Tensor, gate_index: Any, capacity_factor: Any, top_k: Any, overlap: Any,
            reserve_dims: Any, adaptive_r: Any, megablocks_size: Any, dtype: Optional[torch.dtype]) -> CallPlan:
    reserve_dims = require_layer_input(layer, input, reserve_dims, _WHERE)
    call = resolve_switches(layer, _WHERE, gate_index, capacity_factor, top_k, overlap, adaptive_r, megablocks_size,
                            tokens=input.numel() // layer.model_dim)
    if dtype is None:
        dtype = layer._compute_dtype(input, stacklevel=6)
    x = input.reshape(-1, layer.model_dim).to(dtype)
    return CallPlan(reserve_dims, call, dtype, choose_layer_path(layer, x, call, reserve_dims))


def forget_plans(layer: torch.nn.Module) -> Optional[int]:
    """Drops the plans kept on `layer` (its parameters moved or loaded); returns how many there were."""
    plans = layer.__dict__.pop(_PLANS, None)
    return None if plans is None else len(plans)
