"""Prepare stages: a call's routing -> the rows' plan its experts stage reads (``Work.plan``,
``Work.rows``), or the choices as the fused operators take them."""
from .. import ops
from ..ops.dispatch import encode_planned
from ..ops.precision import gemm_dtype
from ..rules.capacity import expert_capacity
from .call_agreement import agree_on_call
from .plans import choice_table, grouped_locations, kept_expert_ids, occupied_rows, plan_routing, RoutingPlan
from .work import Work


def in_gemm_dtype(work: Work) -> None:
    """The [T, k] choices as they are, the products' dtype chosen for them: on a CPU without 16-bit
    dot products, busy experts' 16-bit data widens (tutel.ops.precision)."""
    x = work.x
    work.dtype = gemm_dtype(x.dtype, x.device, work.expert_ids.numel() / max(work.experts.num_experts, 1))


def kept_choices(work: Work) -> None:
    """Tutel's crit as [T, k] choices (the dropped ones given the id E, which the operators skip)
    and weights, in_gemm_dtype."""
    crit = work.crit
    work.expert_ids = kept_expert_ids(crit, work.dropless).t()
    work.weights = choice_table(crit.gates_s).t()
    in_gemm_dtype(work)


def kept_sorted(work: Work) -> None:
    """kept_choices, then sorted_plan."""
    kept_choices(work)
    sorted_plan(work)


def sorted_rows(work: Work) -> None:
    """The choices sorted by expert and the tokens copied into the grouped rows."""
    work.plan = plan = plan_routing(work.expert_ids, work.experts.num_experts, work.ops)
    if work.ops is not None:  # nothing records: the operator itself (what encode_grouped runs)
        work.rows = work.ops.choice_rows(work.x, plan.slot_choices, plan.locations.shape[0])
    else:
        work.rows = ops.encode_grouped(work.x, plan.slot_choices, plan.locations)


def sorted_plan(work: Work) -> None:
    """The choices sorted by expert (the pieces gather each piece's rows themselves)."""
    work.plan = plan_routing(work.expert_ids, work.experts.num_experts, work.ops)


def planned_rows(work: Work) -> None:
    """route_experts' grouped buffer of static size (T x k rows dropless, E x capacity), filled:
    one "expert" of `rows` slots (indices None: every choice's expert is 0), each slot named by at
    most one choice; the experts read the group ends only."""
    routing = work.routing
    rows = routing.row_choices.shape[0]
    work.plan = RoutingPlan(None, routing.grouped_locations, None, None, routing.dispatch_count, routing.ends)
    grouped = encode_planned(work.x, None, routing.grouped_locations, 1, rows,
                             None if work.at_combine else routing.weights)
    work.rows = grouped.view(rows, work.x.shape[1])


def planned_slots(work: Work) -> None:
    """Tutel's [E, C, M] slot buffer from route_experts' routing at its static capacity (its grouped
    buffer holds E x C rows): each kept choice's row at its expert's GShard slot, zero rows
    elsewhere; the plan is the routing's [k, T] expert and slot tables, as ``slots`` makes them."""
    _slots_of_routing(work, work.routing.row_choices.shape[0] // max(work.experts.num_experts, 1))


def largest_load(dispatch_count) -> int:
    """The largest number of choices routed to one expert, read on the host (one synchronisation:
    the dropless slot buffer's shape needs it, as Tutel's dropless capacity does)."""
    return max(dispatch_count.tolist(), default=0)


def largest_load_slots(work: Work) -> None:
    """planned_slots for dropless routing: the capacity is Tutel's dropless one, the largest load
    (largest_load; one process, no exchange to align for), so no choice is dropped."""
    routing = work.routing
    choices, tokens = routing.expert_ids.shape
    _slots_of_routing(work, expert_capacity(0.0, choices, tokens, work.experts.num_experts,
                                            max_load=lambda: largest_load(routing.dispatch_count)))


def _slots_of_routing(work: Work, capacity: int) -> None:
    routing = work.routing
    work.plan = indices, locations = routing.expert_ids, routing.locations
    work.rows = encode_planned(work.x, indices, locations, work.experts.num_experts, capacity,
                               None if work.at_combine else routing.weights)


def occupied(work: Work) -> None:
    """megablocks: the tokens straight into the experts' occupied rows (each expert's load rounded
    up to the block); reads the loads on the host (the shapes need them).  The plan: the [k, T]
    tables of the rows as one expert, and each expert's row count."""
    crit = work.crit
    group_rows = occupied_rows(crit.dispatch_count, crit.capacity, work.megablocks_size)
    indices, locations, total = grouped_locations(crit, group_rows)
    work.plan = (indices, locations, group_rows)
    gates = None if work.at_combine else choice_table(crit.gates_s)
    work.rows = encode_planned(work.x, indices, locations, 1, total, gates).view(total, work.x.shape[1])


def slots(work: Work) -> None:
    """Tutel's [E, C, M] slot buffer (of the layer's own routing: its tables need no checks); the plan
    is the routing's [k, T] expert and slot tables."""
    crit = work.crit
    work.plan = indices, locations = choice_table(crit.indices_s), choice_table(crit.locations_s)
    gates = None if work.at_combine else choice_table(crit.gates_s)
    work.rows = encode_planned(work.x, indices, locations, crit.num_global_experts, crit.capacity, gates)


def agreed_slots(work: Work) -> None:
    """Several processes: every process of the group agrees on the call's capacity and exchange
    settings (tutel.paths.call_agreement), then Tutel's slot buffer at that capacity."""
    crit, ctx = work.crit, work.experts.ctx
    work.crit = crit._replace(capacity=agree_on_call(ctx.group, work.x.device, crit.capacity,
                                                     ctx.a2a_ffn_overlap_degree, ctx.adaptive_degree))
    slots(work)

