"""The rows' plans: how a call's (token, expert) choices are laid out as rows for the experts.

* a *sorted plan* (``plan_routing``): the choices sorted by expert, grouped rows with the group
  ends the grouped products read;
* Tutel's *crit* tables (``choice_table``): the k lists of [T] tensors of Tutel's routing read as
  one [k, T] table, with the dropped choices marked (``kept_expert_ids``);
* the *occupied rows* of megablocks (``occupied_rows``, ``grouped_locations``): each expert's
  load rounded up to a block, one grouped buffer.
"""
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from ..ops.backend import operators_for
from ..rules.capacity import align_up


class RoutingPlan(NamedTuple):
    """The chosen (token, expert) pairs sorted by expert: slot i of the grouped rows holds
    choice ``slot_choices[i]`` (= t * k + j); ``locations`` [k, T] gives each choice's slot (N =
    dropped)."""
    indices: Optional[torch.Tensor]  # None: the grouped rows form one "expert" (0) for encode / decode
    locations: torch.Tensor  # [k, T] int32 slot of each choice, N for ids outside [0, E)
    slot_choices: Optional[torch.Tensor]  # [N] int64 choice held by each slot (the dropped ones last, in order)
    sorted_ids: Optional[torch.Tensor]  # [N] expert of each slot (E for the dropped ones, which sort last)
    counts: torch.Tensor  # [E] int64 rows per expert
    offsets: torch.Tensor  # [E] int32 end of each expert's rows


def plan_routing(expert_ids: torch.Tensor, num_experts: int, ops: Any = None) -> RoutingPlan:
    """Sorts the T*k choices by expert (stably, token-major; ids outside [0, E) last) with tutel's
    ``group_by_expert`` operator: one counting pass on CPU, two launches with no host
    synchronisation on CUDA (tensor operations elsewhere, tutel.ops.backend).  `ops`: the device's
    operators where the caller has them at hand."""
    locations, slot_choices, sorted_ids, counts, ends = \
        (operators_for(expert_ids.device) if ops is None else ops).group_by_expert(expert_ids, num_experts)
    return RoutingPlan(None, locations, slot_choices, sorted_ids, counts, ends)


def plan_piece(plan: RoutingPlan, start: int, end: int) -> RoutingPlan:
    """The routing plan of grouped rows [start, end): group ends shifted and clipped to the piece
    (the plan itself when the piece is every row)."""
    if start == 0 and end == plan.slot_choices.shape[0]:
        return plan
    offsets = (plan.offsets - start).clamp(0, end - start)
    return RoutingPlan(plan.indices, plan.locations, plan.slot_choices[start:end], plan.sorted_ids[start:end],
                       plan.counts, offsets)


class ChoiceRows(list):
    """Tutel's list of k [T] tensors (a crit tuple's indices_s, locations_s, gates_s) made from the
    rows of one [k, T] table, which it keeps in ``table``: choice_table then hands the table back
    without looking at the rows.  Any change to the list forgets the table."""
    __slots__ = ("table",)


def _forgetting(method):
    def changed(self, *args, **kwargs):
        self.table = None
        return method(self, *args, **kwargs)
    changed.__name__, changed.__doc__ = method.__name__, method.__doc__
    return changed


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove",
              "reverse", "sort", "clear"):
    setattr(ChoiceRows, _name, _forgetting(getattr(list, _name)))


def choice_rows(*tables: torch.Tensor) -> Tuple[list, ...]:
    """Tutel's lists of the rows of each [k, T] table: ChoiceRows, or plain lists where torch.compile
    traces (it builds no list subclass)."""
    if torch.compiler.is_compiling():
        return tuple(list(table.unbind(0)) for table in tables)
    rows = []
    for table in tables:
        rows.append(ChoiceRows(table.unbind(0)))  # (list's own constructor: no Python call per list)
        rows[-1].table = table
    return tuple(rows)


def choice_table(choices) -> torch.Tensor:
    """[k, T] from Tutel's list of k [T] tensors (or a [k, T] tensor).  The lists of
    extract_critical are the rows of one [k, T] tensor (unbind): that tensor is used as it is."""
    if not isinstance(choices, (list, tuple)):
        return choices
    table = getattr(choices, "table", None)  # a ChoiceRows unchanged since it was made
    if table is not None:
        return table
    if torch.compiler.is_compiling():  # (storage offsets are not traceable; the stack is, and cheap there)
        return torch.stack(list(choices))
    base = choices[0]._base if len(choices) else None
    if base is not None and base.dim() == 2 and base.shape[0] == len(choices) and all(
            c._base is base and c.storage_offset() == base.storage_offset() + j * base.stride(0) and
            c.shape[0] == base.shape[1] and c.stride(0) == base.stride(1) for j, c in enumerate(choices)):
        return base
    return torch.stack(list(choices))


def kept_expert_ids(crit, dropless: bool) -> torch.Tensor:
    """[k, T] expert ids of Tutel's routing `crit` with the dropped choices (past the capacity, or
    Tutel's negative "not dispatched" index) given the id E, which the grouped operators skip."""
    num_experts, indices_s, locations_s, _, capacity, *_ = crit  # not crit[:5]: PyTorch 2.6's torch.compile fails on it
    indices = choice_table(indices_s)
    # Nothing is dropped when the call is dropless (the capacity is the largest load) or the
    # capacity reaches T (an expert receives at most T choices).
    if dropless or capacity >= indices.shape[1]:
        return indices
    locations = choice_table(locations_s)
    kept = (locations < capacity) & (indices >= 0)
    return torch.where(kept, indices, torch.full_like(indices, num_experts))


def occupied_rows(dispatch_count: torch.Tensor, capacity: int, block: int) -> List[int]:
    """Rows to compute per local expert: the load rounded up to `block`, at most `capacity`.

    Reads the counts on the host (one synchronisation, by design: the shapes depend on them)."""
    loads = dispatch_count.tolist()
    return [min(align_up(int(load), block), capacity) for load in loads]


def grouped_locations(crit, rows: List[int]) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """The routing of `crit` re-targeted at the grouped buffer.

    Slot (e, l) becomes row ``offset[e] + l`` of one [N, M] buffer, described as a single
    "expert" with capacity N = sum(rows), so the ordinary encode / decode operators fill and read
    it.  Dropped choices (l >= capacity, or a negative expert index) get location N, which is
    dropped as well.

    Returns (indices [k, T] of zeros, locations [k, T], N)."""
    num_experts, indices_s, locations_s, _, capacity, *_ = crit  # not crit[:5]: PyTorch 2.6's torch.compile fails on it
    indices, locations = choice_table(indices_s), choice_table(locations_s)
    total = sum(rows)
    starts = torch.tensor([0] + rows[:-1], dtype=torch.int64, device=indices.device).cumsum(0)
    grouped = (starts[indices.long().clamp(min=0)] + locations).to(torch.int32)
    # A negative expert index (Tutel's "not dispatched") is dropped like a location >= capacity.
    kept = (locations < capacity) & (indices >= 0)
    grouped = torch.where(kept, grouped, torch.full_like(grouped, total))
    return torch.zeros_like(indices), grouped, total
