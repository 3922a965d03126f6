"""Finalize stages: the experts' outputs back in token order, weighted by the routing."""
from ..ops.checks import FLOATING_DTYPES
from ..ops.dispatch import decode_planned
from .plans import choice_table
from .work import Work


def _combine_gates(work: Work):
    """The routing weights as the combine takes them ([k, T], or Tutel's k lists), or None where they
    applied at the encode or are all 1."""
    if not work.at_combine:
        return None
    if work.crit is not None:
        return choice_table(work.crit.gates_s)
    if work.routing is not None:
        return work.routing.weights
    return None if work.weights is None else work.weights.t()


def grouped_combine(work: Work) -> None:
    """Each token's rows of the grouped outputs, weighted and summed (tutel.ops.decode on the
    grouped buffer as one "expert")."""
    out, plan, gates = work.out, work.plan, _combine_gates(work)
    buffer = out.reshape(1, out.shape[-2], out.shape[-1])
    if work.ops is not None and (gates is None or gates.dtype in FLOATING_DTYPES):
        # nothing records: the operator itself (what decode_planned runs)
        work.y = work.ops.gather_slots(buffer, plan.indices, plan.locations, gates, None)[0]
    else:
        work.y = decode_planned(buffer, plan.indices, plan.locations, gates)


def slots_combine(work: Work) -> None:
    """Tutel's [E, C, O] slot buffer (megablocks' occupied rows: one expert) back to the tokens, by
    the [k, T] expert and slot tables the plan starts with."""
    plan = work.plan
    work.y = decode_planned(work.out, plan[0], plan[1], _combine_gates(work))
