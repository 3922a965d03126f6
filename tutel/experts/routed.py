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
with 16-byte aligned rows, where it has a kernel; tutel's tiled grouped kernels for other dtypes
and odd feature sizes, which read the group ends on the device too), tutel's fused gated unit and
the weighted combine; inference of up to 32 tokens is instead one call of tutel's ``decode_experts``
(``tutel.ops.decode_experts``), which reads each chosen expert's matrices once.  On CPU 16-bit data on a CPU without native 16-bit dot products is
multiplied in float32 once experts average 32 rows or more (``tutel.ops.precision``); the result
keeps x's dtype either way.  On CPU without autograd, gated experts (``gate``, no ``post_fn``) run in
one call of tutel's ``routed_gated_experts`` operator.  ``tutel.rules.paths`` chooses among these.
"""
from typing import Callable, Dict, NamedTuple, Optional, Union

import torch

from .. import ops
from .._extension import load_extension
from ..rules.autocast import autocast_dtype
from ..ops.backend import operators_for
from ..ops.decode_experts import decode_experts, decode_experts_supported
from ..ops.checks import accumulation_dtype, require_dim, require_floating, require_tensor
from ..ops.gated_units import SWIGLU as SWIGLU_UNIT, GatedUnit, check_unit, gated_unit, unit_scalars
from ..ops.grouped_mm import bias_costs_a_launch, grouped_rows_mm
from ..ops.precision import gemm_dtype, widened
from ..ops.tracing import direct_call_allowed, is_compiling
from ..rules.paths import EXPERTS, Path, choose_path

SWIGLU = "swiglu"
GATES = (SWIGLU,)


class RoutingPlan(NamedTuple):
    """The chosen (token, expert) pairs sorted by expert: slot i of the grouped rows holds
    choice ``slot_choices[i]`` (= t * k + j); ``locations`` [k, T] gives each choice's slot (N =
    dropped)."""
    indices: Optional[torch.Tensor]  # None: the grouped rows form one "expert" (0) for encode / decode
    locations: torch.Tensor  # [k, T] int32 slot of each choice, N for ids outside [0, E)
    slot_choices: torch.Tensor  # [N] int64 choice held by each slot (the dropped ones last, in order)
    sorted_ids: Optional[torch.Tensor]  # [N] expert of each slot (E for the dropped ones, which sort last)
    counts: torch.Tensor  # [E] int64 rows per expert
    offsets: torch.Tensor  # [E] int32 end of each expert's rows


def plan_routing(expert_ids: torch.Tensor, num_experts: int) -> RoutingPlan:
    """Sorts the T*k choices by expert (stably, token-major; ids outside [0, E) last) with tutel's
    ``group_by_expert`` operator: one counting pass on CPU, two launches with no host
    synchronisation on CUDA (tensor operations elsewhere, tutel.ops.backend)."""
    locations, slot_choices, sorted_ids, counts, ends = \
        operators_for(expert_ids.device).group_by_expert(expert_ids, num_experts)
    return RoutingPlan(None, locations, slot_choices, sorted_ids, counts, ends)


class _ExpertsCall:
    """The experts of one routed_experts call, applied to grouped rows.  (A plain class, not a
    NamedTuple: PyTorch 2.6's torch.compile cannot call a method of a tuple that holds tensors.)"""

    def __init__(self, up_weight: torch.Tensor, down_weight: torch.Tensor, up_bias: Optional[torch.Tensor],
                 down_bias: Optional[torch.Tensor], transposed: bool, gate: Optional[GatedUnit],
                 gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]],
                 activation: Optional[Callable[[torch.Tensor], torch.Tensor]],
                 post_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]):
        self.up_weight, self.down_weight, self.up_bias, self.down_bias = up_weight, down_weight, up_bias, down_bias
        self.transposed, self.gate, self.gate_fn, self.activation, self.post_fn = \
            transposed, gate, gate_fn, activation, post_fn

    def __call__(self, rows: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        """[n, H] rows grouped as `plan` says -> [n, O] expert outputs (before the routing weights);
        the rows past the kept ones hold anything (decode and the pieces read only the kept rows,
        and their gradients flow back only into them).  The biases ride in the grouped products,
        except a gated unit's up bias where the product would add it in a launch of its own
        (beside grouped_mm, on devices): the unit's kernel adds it instead."""
        unit_bias = self.up_bias if self.gate is not None and self.up_bias is not None and \
            bias_costs_a_launch(rows, self.up_weight, self.transposed) else None
        hidden = grouped_rows_mm(rows, self.up_weight, plan.offsets, self.transposed,
                                 self.up_bias if unit_bias is None else None, zero_tail=False)
        if self.gate is not None:
            hidden = gated_unit(hidden, self.gate, bias=None if unit_bias is None else unit_bias.to(hidden.dtype),
                                offsets=None if unit_bias is None else plan.offsets)
        elif self.gate_fn is not None:
            hidden = self.gate_fn(hidden)
        else:
            hidden = self.activation(hidden)
        if hidden.dtype != self.down_weight.dtype:
            hidden = hidden.to(self.down_weight.dtype)
        out = grouped_rows_mm(hidden, self.down_weight, plan.offsets, self.transposed, self.down_bias,
                              zero_tail=False)
        return out if self.post_fn is None else self.post_fn(out)


# Without autograd on CPU the grouped rows go through the experts in pieces whose up projection
# takes about this many bytes, each gathered from the tokens and added back into the result on
# its own: no buffer spans all T*k rows, so memory stays bounded at any T (the operators'
# buffers come from tutel's block cache, so reusing them costs no page faults).  Pieces of at
# least _MIN_PIECE_ROWS rows leave each expert a few hundred rows per piece: with 8 MiB / 512-row
# pieces the per-expert GEMMs were small enough to cost 1.1-1.4x at T=2048..8192 (fp32, 2-core
# Zen 3, docs/performance.md's blocks).
_PIECE_BYTES = 64 << 20
_MIN_PIECE_ROWS = 4096


def piece_rows(row_bytes: int) -> int:
    """Grouped rows per piece when one row's up projection takes `row_bytes`."""
    return max(_MIN_PIECE_ROWS, _PIECE_BYTES // max(1, row_bytes))


def fits_one_call(rows: int) -> bool:
    """Whether inference of `rows` grouped rows runs in one operator call (gated_experts_in_one_call):
    up to the rows of the smallest piece, where the calls' fixed costs still matter."""
    return rows <= _MIN_PIECE_ROWS


def _piece_rows(up_weight: torch.Tensor, transposed: bool) -> int:
    """Grouped rows per piece of routed_experts."""
    width = up_weight.shape[2] if transposed else up_weight.shape[1]
    return piece_rows(width * up_weight.element_size())


def combine_without_grad(x: torch.Tensor, weights: Optional[torch.Tensor], plan: RoutingPlan,
                         products: Callable[[torch.Tensor, RoutingPlan], torch.Tensor], rows_per_piece: int
                         ) -> torch.Tensor:
    """The routing-weighted sum of every token's expert outputs, on CPU with nothing to differentiate.

    ``products(rows, plan)`` maps [n, H] rows grouped by expert as `plan` says to their [n, O]
    expert outputs; only the kept rows (ids inside [0, E), sorted first) run.  Up to
    `rows_per_piece` of them are copied into grouped rows and combined by tutel's operators
    directly (their arguments come from a plan of tutel's, so the checks and autograd wrappers of
    tutel.ops, which cost more than a decoding step's rows, are skipped); more run in pieces
    (_run_in_pieces).  Returns [T, O]: in the products' dtype, float32 for 16-bit ones in pieces."""
    kept = int(plan.offsets[-1])  # the group ends, on the CPU: no synchronisation
    if kept > rows_per_piece:
        return _run_in_pieces(x, weights, plan, kept, rows_per_piece, products)
    # Capacity `kept`: the dropped choices (slot N = T*k) stay out of the grouped rows.
    rows = torch.ops.tutel.scatter_slots(x, plan.indices, plan.locations, None, None, 1, kept)[0]
    out = products(rows.view(kept, x.shape[1]), _plan_piece(plan, 0, kept))
    # The [T, k] weights read in place as [k, T], whatever their floating dtype.
    gates = None if weights is None else weights.t()
    return torch.ops.tutel.gather_slots(out.view(1, kept, out.shape[-1]), plan.indices, plan.locations, gates,
                                        None)[0]


def _run_in_pieces(x: torch.Tensor, weights: Optional[torch.Tensor], plan: RoutingPlan, kept: int, piece: int,
                   experts: Callable[[torch.Tensor, RoutingPlan], torch.Tensor]) -> torch.Tensor:
    """The routed experts' weighted sum for every token, `piece` grouped rows at a time: each piece's
    rows are gathered from `x`, and its outputs, times their routing weights, added into the
    float32 (float64) result.  Only the `kept` rows (ids inside [0, E), sorted first) run."""
    k = plan.locations.shape[0]
    choices = plan.slot_choices[:kept]
    tokens = torch.div(choices, k, rounding_mode="floor")
    slot_weights = None if weights is None else weights.reshape(-1).index_select(0, choices)
    y = None
    for start in range(0, kept, piece):
        end = min(kept, start + piece)
        # tutel's select_rows: index_select into a reused buffer instead of fresh pages
        part = experts(torch.ops.tutel.select_rows(x, tokens[start:end]), _plan_piece(plan, start, end))
        if y is None:
            y = torch.zeros((x.shape[0], part.shape[1]), dtype=accumulation_dtype(part.dtype), device=x.device)
        part = part.to(y.dtype)
        if slot_weights is not None:
            part.mul_(slot_weights[start:end].to(y.dtype).unsqueeze(1))
        y.index_add_(0, tokens[start:end], part)
    return y


def _plan_piece(plan: RoutingPlan, start: int, end: int) -> RoutingPlan:
    """The routing plan of grouped rows [start, end): group ends shifted and clipped to the piece
    (the plan itself when the piece is every row)."""
    if start == 0 and end == plan.slot_choices.shape[0]:
        return plan
    offsets = (plan.offsets - start).clamp(0, end - start)
    return RoutingPlan(plan.indices, plan.locations, plan.slot_choices[start:end], plan.sorted_ids[start:end],
                       plan.counts, offsets)


# tutel::routed_gated_experts' CPU implementation bound directly (csrc/ops/cpu/routed_experts_cpu.cpp):
# with the caches cold the dispatcher costs about 50 us per call, as much as the operator's own fixed work.
routed_gated_experts_cpu = load_extension().routed_gated_experts


def gated_experts_in_one_call(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                              up_weight: torch.Tensor, down_weight: torch.Tensor, *,
                              gate_weight: Optional[torch.Tensor] = None, up_bias: Optional[torch.Tensor] = None,
                              down_bias: Optional[torch.Tensor] = None, transposed: bool = False,
                              unit: GatedUnit = SWIGLU_UNIT) -> torch.Tensor:
    """routed_experts' result for gated experts on CPU without autograd, in one call of tutel's
    ``routed_gated_experts`` operator: the steps of combine_without_grad with the gated unit, without
    an operator call and its Python around each (at decoding sizes those cost a third of the
    weights' streaming).

    Args:
        x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, transposed: as for
            routed_experts, every tensor on the CPU and the floating ones in x's dtype (biases are
            converted); nothing may require a gradient.
        gate_weight: the gates' own matrices, of up_weight's shape (then up_weight holds the ups
            only, as in moe_layer's llama_ffn), or None for up_weight's [gate | up] halves.
        unit: the gated unit (not interleaved with gate_weight).

    Returns:
        [T, O] in x's dtype."""
    check_unit(unit, "tutel.experts.routed_experts")
    up_bias, down_bias = (None if b is None else b.to(x.dtype) for b in (up_bias, down_bias))
    tensors = (x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias)
    operator = routed_gated_experts_cpu if direct_call_allowed(*tensors, gate_weight) \
        else torch.ops.tutel.routed_gated_experts
    return operator(*tensors, bool(transposed), *unit_scalars(unit), bool(unit.interleaved), gate_weight)


def experts_facts(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                  up_weight: torch.Tensor, down_weight: torch.Tensor, up_bias: Optional[torch.Tensor],
                  down_bias: Optional[torch.Tensor], unit: Optional[GatedUnit],
                  post_fn: Optional[Callable]) -> Dict[str, object]:
    """The facts of a routed_experts call (tutel.rules.paths.FACTS) for its tensors as they will be
    computed (after autocast and widening)."""
    device = x.device.type
    return {
        "device": device if device in ("cpu", "cuda") else "other",
        "gradient": torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weights, up_weight, down_weight, up_bias, down_bias)),
        "traced": is_compiling(),
        "gated_experts": unit is not None and post_fn is None and down_weight.dtype == x.dtype,
        "rows_fit_one_call": fits_one_call(expert_ids.numel()),
        "decode_kernel": decode_experts_supported(x.shape[0], expert_ids.shape[1], x.dtype, x.device,
                                                  experts=down_weight.shape[0]),
    }


def gate_unit_of(gate: Union[None, str, GatedUnit]) -> Optional[GatedUnit]:
    """The GatedUnit a `gate` argument names (None for None); ValueError for anything else."""
    if gate is None or isinstance(gate, GatedUnit):
        return gate
    if isinstance(gate, str) and gate == SWIGLU:
        return SWIGLU_UNIT
    raise ValueError(f"tutel.experts.routed_experts: `gate` must be one of {GATES} or a "
                     f"tutel.ops.gated_units.GatedUnit, got {gate!r}")


def _check(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, transposed, gate, gate_fn,
           activation) -> None:
    where = "tutel.experts.routed_experts"
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
    given = [name for name, value in (("gate_fn", gate_fn), ("activation", activation)) if value is not None]
    if len(given) > 1 or (gate is None and not given) or (gate is not None and activation is not None):
        raise ValueError(f"{where}: give `gate` ({'/'.join(GATES)}, optionally with the equivalent `gate_fn`), "
                         f"or exactly one of `gate_fn` and `activation`; got "
                         f"{(['gate'] if gate is not None else []) + given or 'none'}")
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
    out_dtype = x.dtype
    compute = autocast_dtype(x.device.type)
    if compute is not None:  # grouped_mm is not autocast-aware: cast as autocast does for mm
        x, up_weight, down_weight = (t if t.dtype in (compute, torch.float64) else t.to(compute)
                                     for t in (x, up_weight, down_weight))
    elif up_weight.dtype != x.dtype:
        x = x.to(up_weight.dtype)
    wide = gemm_dtype(up_weight.dtype, x.device, expert_ids.numel() / up_weight.shape[0])
    if wide != up_weight.dtype:  # 16-bit data on a CPU without 16-bit dot products (tutel.ops.precision)
        x, up_weight, down_weight = (widened(t, wide) for t in (x, up_weight, down_weight))
    unit = gate_unit_of(gate)
    path = choose_path(EXPERTS, experts_facts(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias,
                                              unit, post_fn)).path
    if path is Path.EXPERTS_ONE_CALL:
        return gated_experts_in_one_call(x, expert_ids, weights, up_weight, down_weight, up_bias=up_bias,
                                         down_bias=down_bias, transposed=transposed, unit=unit).to(out_dtype)
    if path is Path.EXPERTS_DECODE:
        return decode_experts(x, expert_ids, weights, up_weight, down_weight, up_bias=up_bias, down_bias=down_bias,
                              transposed=transposed, unit=unit).to(out_dtype)
    plan = plan_routing(expert_ids, up_weight.shape[0])
    total = plan.locations.numel()
    experts = _ExpertsCall(up_weight, down_weight, up_bias, down_bias, transposed, unit, gate_fn, activation, post_fn)
    if path is Path.EXPERTS_PIECES:
        return combine_without_grad(x, weights, plan, experts, _piece_rows(up_weight, transposed)).to(out_dtype)
    rows = ops.encode_grouped(x, plan.slot_choices, plan.locations)
    out = experts(rows, plan)
    out = out.reshape(1, total, out.shape[-1])
    y = ops.decode(out, plan.indices, plan.locations, gates=None if weights is None else weights.t())
    return y.to(out_dtype)
