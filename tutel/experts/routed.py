"""Routed experts: every token through its k chosen experts, in one call, without a capacity.

``routed_experts(x, expert_ids, weights, up_weight, down_weight, ...)`` computes, for every
token t of ``x`` [T, H],

    y[t] = sum_j  weights[t, j] * post_fn( down_e( gate( up_e(x[t]) ) ) ),   e = expert_ids[t, j]

where ``up_e(v) = v @ up_weight[e]^T + up_bias[e]`` (``F.linear`` layout; ``transposed=True``
means ``v @ up_weight[e]``) and the same for ``down_e``.  Choices whose id lies outside
[0, E) contribute nothing (expert-parallel callers mark the tokens other processes own so).

How the caller names the activation
-----------------------------------
* ``gate="swiglu"``: the up projection holds the gate and up halves one after the other
  ([n, 2I] = [gate | up]) and the expert computes ``silu(gate) * up``.  This is the rule of
  LLaMA, Mixtral, Qwen-MoE, DeepSeek and the default ``_apply_gate`` of transformers' experts
  with ``act_fn = silu``.  Naming it lets the implementation fuse it (``tutel.ops.gated_units``,
  one pass forward and one backward on CPU); a caller that is not sure the rule applies passes
  ``gate_fn`` instead.
* ``gate=GatedUnit(alpha, up_offset, limit, interleaved)`` (``tutel.ops.gated_units``): the
  clamped, offset and interleaved variants of the same rule, e.g. gpt-oss'
  ``GatedUnit(1.702, 1.0, 7.0, interleaved=True)``, fused the same way.
* ``gate_fn``: any callable [n, U] -> [n, I] (e.g. a transformers experts module's bound
  ``_apply_gate``, gpt-oss' clamped interleaved variant).  Called on the up projection as is.
* ``activation``: an elementwise callable (``F.gelu``, a module's ``act_fn``) for experts
  without a gate (U = I).

Give ``gate`` (optionally together with the ``gate_fn`` it names, which is then not called),
or exactly one of ``gate_fn`` and ``activation``.

The function is differentiable in x, weights, both weight tensors and the biases, and traceable
by ``torch.compile(fullgraph=True)`` (the grouped products are one opaque operator,
``tutel.ops.grouped_mm.grouped_rows_mm``).  On CUDA a call is a handful of kernels with nothing
read back to the host, so CUDA graphs capture it: tutel's ``group_by_expert`` (the choices sorted by
expert, two launches), the grouped rows' copy, PyTorch's ``grouped_mm`` for the products (bfloat16
with 16-byte aligned rows, where it has a kernel; tutel's tiled grouped kernels for odd feature
sizes, and for other dtypes under graph capture or torch.compile, which read the group ends on the
device too), tutel's fused gated unit and the weighted combine; inference of up to 32 tokens is
instead one call of tutel's ``decode_experts`` (``tutel.ops.decode_experts``), which reads each
chosen expert's matrices once.  Eager float16 / float32 / float64 calls read the group ends back
once and run one cuBLAS product per busy expert (``tutel.ops.per_expert_mm``).  On a CPU without
native 16-bit dot products, 16-bit data is multiplied in float32 once experts average enough rows
(``tutel.ops.precision``); the result keeps x's dtype either way.  On CPU without autograd, gated
experts (``gate``, no ``post_fn``) run in one call of tutel's ``routed_gated_experts`` operator.
``tutel.rules.paths`` chooses among these and ``tutel.paths`` runs them.
"""
from typing import Callable, Dict, Optional, Union

import torch

from ..ops.backend import operators_for
from ..ops.checks import require_dim, require_floating, require_tensor
from ..ops.gated_units import SWIGLU as SWIGLU_UNIT, GatedUnit, check_unit
from ..ops.precision import gemm_dtype, widened
from ..paths import WeightExperts, Work, run
from ..paths.facts import experts_facts
from ..paths.settled import settled_state
from ..rules.autocast import any_autocast, autocast_dtype
from ..rules.paths import EXPERTS, Path, choose_path

SWIGLU = "swiglu"
GATES = (SWIGLU,)


def gate_unit_of(gate: Union[None, str, GatedUnit]) -> Optional[GatedUnit]:
    """The GatedUnit a `gate` argument names (None for None); ValueError for anything else."""
    if gate is None or isinstance(gate, GatedUnit):
        return gate
    if isinstance(gate, str) and gate == SWIGLU:
        return SWIGLU_UNIT
    raise ValueError(f"tutel.experts.routed_experts: `gate` must be one of {GATES} or a "
                     f"tutel.ops.gated_units.GatedUnit, got {gate!r}")


def check_routing(x, expert_ids, weights, where: str) -> None:
    """TypeError / ValueError (from `where`, naming the argument) unless `x` is [T, H] floating point,
    `expert_ids` [T, k] integers and `weights` None or floating point of expert_ids' shape."""
    require_floating(x, "x", where)
    require_dim(x, 2, "x", where)
    require_tensor(expert_ids, "expert_ids", where)
    require_dim(expert_ids, 2, "expert_ids", where)
    if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or expert_ids.dtype == torch.bool:
        raise TypeError(f"{where}: `expert_ids` must hold integers, got {expert_ids.dtype}")
    if expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: `expert_ids` must be [T, k] with T = {x.shape[0]} tokens of `x`, "
                         f"got {tuple(expert_ids.shape)}")
    if weights is not None:
        require_floating(weights, "weights", where)
        if weights.shape != expert_ids.shape:
            raise ValueError(f"{where}: `weights` must have the shape of `expert_ids` {tuple(expert_ids.shape)}, "
                             f"got {tuple(weights.shape)}")


def check_gate_rule(gate, gate_fn, activation, where: str, gates: str) -> None:
    """ValueError (from `where`) unless the call gives `gate` (`gates` says which, optionally with the
    equivalent `gate_fn`), or exactly one of `gate_fn` and `activation`."""
    given = [name for name, value in (("gate_fn", gate_fn), ("activation", activation)) if value is not None]
    if len(given) > 1 or (gate is None and not given) or (gate is not None and activation is not None):
        raise ValueError(f"{where}: give `gate` ({gates}, optionally with the equivalent `gate_fn`), "
                         f"or exactly one of `gate_fn` and `activation`; got "
                         f"{(['gate'] if gate is not None else []) + given or 'none'}")


def _check(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, transposed, gate, gate_fn,
           activation) -> None:
    where = "tutel.experts.routed_experts"
    check_routing(x, expert_ids, weights, where)
    for name, weight in (("up_weight", up_weight), ("down_weight", down_weight)):
        require_floating(weight, name, where)
        require_dim(weight, 3, name, where)
    num_experts = up_weight.shape[0]
    if down_weight.shape[0] != num_experts:
        raise ValueError(f"{where}: `up_weight` holds {num_experts} experts but `down_weight` {down_weight.shape[0]}")
    up_in, up_out = (up_weight.shape[1], up_weight.shape[2]) if transposed else (up_weight.shape[2], up_weight.shape[1])
    down_in, down_out = (down_weight.shape[1], down_weight.shape[2]) if transposed \
        else (down_weight.shape[2], down_weight.shape[1])
    layout = "[E, H, U]" if transposed else "[E, U, H]"
    if up_in != x.shape[1]:
        raise ValueError(f"{where}: `up_weight` {tuple(up_weight.shape)} must be {layout} with H = {x.shape[1]} "
                         f"(transposed={transposed})")
    check_gate_rule(gate, gate_fn, activation, where, "/".join(GATES))
    gate_unit_of(gate)
    if gate is not None and (up_out % 2 or up_out // 2 != down_in):
        raise ValueError(f"{where}: with gate={gate!r} the up projection's {up_out} outputs must be twice the "
                         f"down projection's {down_in} inputs")
    if activation is not None and up_out != down_in:
        raise ValueError(f"{where}: with an activation (no gate) the up projection's {up_out} outputs must equal "
                         f"the down projection's {down_in} inputs")
    for name, bias, size in (("up_bias", up_bias, up_out), ("down_bias", down_bias, down_out)):
        if bias is not None:
            require_floating(bias, name, where)
            if tuple(bias.shape) != (num_experts, size):
                raise ValueError(f"{where}: `{name}` must be [E, {size}] = [{num_experts}, {size}], "
                                 f"got {tuple(bias.shape)}")


def routed_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                   up_weight: torch.Tensor, down_weight: torch.Tensor, *,
                   up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                   transposed: bool = False, gate: Union[None, str, GatedUnit] = None,
                   gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   post_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """The gate-weighted sum of each token's routed experts (see the module docstring).

    Args:
        x: [T, H] tokens.
        expert_ids: [T, k] integer expert ids; ids outside [0, E) contribute nothing.
        weights: [T, k] routing weight of each choice; None means 1.
        up_weight: [E, U, H] (``transposed=False``, ``F.linear`` layout) or [E, H, U];
            U = 2 I for gated experts, I otherwise.
        down_weight: [E, O, I] or [E, I, O].
        up_bias, down_bias: optional [E, U] and [E, O].
        transposed: the weights' layout, as above.
        gate: ``"swiglu"`` for silu(gate) * up on concatenated halves, or a GatedUnit (fused).
        gate_fn: callable [n, U] -> [n, I] on the up projection (any other gate).
        activation: elementwise callable for experts without a gate.
        post_fn: optional row-wise callable on the [n, O] expert outputs before weighting.

    Returns:
        [T, O] in x's dtype.
    """
    _check(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, transposed, gate, gate_fn, activation)
    unit = gate_unit_of(gate)
    if unit is not None:
        check_unit(unit, "tutel.experts.routed_experts")
    experts = WeightExperts(up_weight, down_weight, up_bias, down_bias, transposed, unit, gate_fn, activation, post_fn)
    return run_routed(x, expert_ids, weights, experts)


def run_routed(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
               experts: WeightExperts) -> torch.Tensor:
    """routed_experts on arguments its checks passed (transformers' "tutel" experts check a module's
    tensors once, when they first see them, and each call's own tensors).  Returns [T, O] in x's
    dtype."""
    out_dtype = x.dtype
    up = experts.up_weight
    compute = autocast_dtype(x.device.type) if any_autocast() else None
    if compute is not None:  # grouped_mm is not autocast-aware: cast as autocast does for mm
        x, up_weight, down_weight = (t if t.dtype in (compute, torch.float64) else t.to(compute)
                                     for t in (x, up, experts.down_weight))
        experts = experts.with_weights(up_weight, down_weight)
    elif up.dtype != x.dtype:
        x = x.to(up.dtype)
    dtype = experts.up_weight.dtype
    # (gemm_dtype keeps every dtype off the CPU: asked only there)
    wide = gemm_dtype(dtype, x.device, expert_ids.numel() / experts.num_experts) if x.device.type == "cpu" else dtype
    if wide != dtype:  # 16-bit data on a CPU without 16-bit dot products (tutel.ops.precision)
        x = widened(x, wide)
        experts = experts.with_weights(widened(experts.up_weight, wide), widened(experts.down_weight, wide))
    state = settled_state()
    ops = None
    if state is None:
        path = choose_path(EXPERTS, experts_facts(x, expert_ids, weights, experts)).path
    else:  # an inference call: the path of the facts' inputs, kept (tutel.paths.settled)
        key = (state, x.device, x.dtype, x.shape[0], expert_ids.shape[1], expert_ids.numel(), experts.num_experts,
               experts.unit is not None, experts.post_fn is None, experts.down_weight.dtype)
        path = _KEPT_PATHS.get(key)
        if path is None:
            if len(_KEPT_PATHS) >= _MAX_KEPT_PATHS:
                _KEPT_PATHS.clear()
            path = _KEPT_PATHS[key] = choose_path(EXPERTS, experts_facts(x, expert_ids, weights, experts)).path
        if path in _STAGED_PATHS:  # nothing records or traces: the stages call the operators directly
            ops = operators_for(x.device)
    y = run(path, Work(x, experts, expert_ids=expert_ids, weights=weights, ops=ops)).y
    return y if y.dtype == out_dtype else y.to(out_dtype)  # (.to costs a dispatch even with nothing to do)


# The paths of inference calls by what their facts read (run_routed); bounded, as prefills of
# ever-new token counts each add one.
_KEPT_PATHS: Dict[tuple, Path] = {}
_MAX_KEPT_PATHS = 1024
# The paths whose stages take the device's operators from the call (tutel.paths.work.Work.ops).
_STAGED_PATHS = frozenset((Path.EXPERTS_GROUPED, Path.EXPERTS_PER_EXPERT, Path.EXPERTS_PIECES))
