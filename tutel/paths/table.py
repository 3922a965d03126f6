"""The table of paths: every path the chooser (tutel.rules.paths) names, as the routing it takes and
its three stages, prepare -> experts -> finalize, each a function of the call's Work; and ``run``,
which runs one.  moe_layer, routed experts and transformers' "tutel" experts all run through it.

An experts implementation is one module of stages (an experts stage, with a prepare stage where
its rows need their own layout) plus one row here and one rule in tutel.rules.paths."""
from typing import Callable, Dict, NamedTuple, Optional

from ..rules.paths import Path
from . import (experts_decode, experts_grouped, experts_module, experts_one_call, experts_per_expert,
               experts_pieces, experts_quantized_decode, finalize, prepare)
from .work import Work

Stage = Callable[[Work], None]

# What a path takes as its routing (the caller routes; tutel.impls.layer_routing for the layer):
CRIT = "crit"          # Tutel's crit tuple (softmax top-k with capacity, or the scored-routing options)
PLANNED = "planned"    # route_experts: the weights and the grouped buffer's plan, computed on the device
ONE_PASS = "one_pass"  # route_without_grad: [T, k] choices, weights, counts and loss in one C++ pass
GIVEN = "given"        # [T, k] choices and weights from the caller (routed experts, transformers)


class PathStages(NamedTuple):
    """One row of the table; None for a stage the path has no work for (a fused operator takes the
    routed choices as they are, or combines the outputs itself)."""
    routing: str
    prepare: Optional[Stage]
    experts: Stage
    finalize: Optional[Stage]


STAGES: Dict[Path, PathStages] = {
    Path.EXPERT_PARALLEL: PathStages(CRIT, prepare.agreed_slots, experts_module.module_across_processes,
                                     finalize.slots_combine),
    Path.STATIC_DECODE: PathStages(PLANNED, None, experts_decode.decode_kernel, None),
    Path.STATIC_SLOTS: PathStages(PLANNED, prepare.planned_slots, experts_module.module_on_slots,
                                  finalize.slots_combine),
    Path.DROPLESS_SLOTS: PathStages(PLANNED, prepare.largest_load_slots, experts_module.module_on_slots,
                                    finalize.slots_combine),
    Path.STATIC_GROUPED: PathStages(PLANNED, prepare.planned_rows, experts_grouped.grouped_products,
                                    finalize.grouped_combine),
    Path.LAYER_IN_TWO_CALLS: PathStages(ONE_PASS, prepare.in_gemm_dtype, experts_one_call.one_call, None),
    Path.GROUPED_ONE_CALL: PathStages(CRIT, prepare.kept_choices, experts_one_call.one_call, None),
    Path.GROUPED_PIECES: PathStages(CRIT, prepare.kept_sorted, experts_pieces.products_in_pieces, None),
    Path.GROUPED: PathStages(CRIT, prepare.occupied, experts_module.module_on_occupied_rows, finalize.slots_combine),
    Path.PADDED: PathStages(CRIT, prepare.slots, experts_module.module_on_slots, finalize.slots_combine),
    Path.EXPERTS_ONE_CALL: PathStages(GIVEN, None, experts_one_call.one_call, None),
    Path.EXPERTS_QUANTIZED_DECODE: PathStages(GIVEN, None, experts_quantized_decode.quantized_decode, None),
    Path.EXPERTS_PIECES: PathStages(GIVEN, prepare.sorted_plan, experts_pieces.products_in_pieces, None),
    Path.EXPERTS_DECODE: PathStages(GIVEN, None, experts_decode.decode_kernel, None),
    Path.EXPERTS_PER_EXPERT: PathStages(GIVEN, prepare.sorted_rows, experts_per_expert.products_per_expert,
                                        finalize.grouped_combine),
    Path.EXPERTS_GROUPED: PathStages(GIVEN, prepare.sorted_rows, experts_grouped.grouped_products,
                                     finalize.grouped_combine),
}


def run(path: Path, work: Work) -> Work:
    """Runs `path`'s three stages on `work`; its ``y`` is then the [T, O] result."""
    stages = STAGES[path]
    if stages.prepare is not None:
        stages.prepare(work)
    stages.experts(work)
    if stages.finalize is not None:
        stages.finalize(work)
    return work


def _name(stage: Optional[Stage]) -> str:
    return "-" if stage is None else f"`{stage.__module__.rsplit('.', 1)[-1]}.{stage.__name__}`"


def stages_table() -> str:
    """The table as markdown (docs/design.md shows it)."""
    lines = ["| path | routing | prepare | experts | finalize |", "|---|---|---|---|---|"]
    for path, row in STAGES.items():
        lines.append(f"| `{path.value}` | {row.routing} | {_name(row.prepare)} | {_name(row.experts)} | "
                     f"{_name(row.finalize)} |")
    return "\n".join(lines)
