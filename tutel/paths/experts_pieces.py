"""Experts stage for CPU inference: the kept grouped rows through the experts in bounded pieces,
tutel's operators called directly (their arguments come from tutel's own plans, so the checks and
autograd wrappers of tutel.ops, which cost more than a decoding step's rows, are skipped), each
piece's outputs weighted and added into the result.  No buffer spans all T*k rows, so memory stays
bounded at any T; the pieces' buffers come from tutel's block cache (no page faults on reuse)."""
from typing import Callable, Optional

import torch

from ..ops import direct
from ..ops.checks import accumulation_dtype
from ..rules.lines import MIN_PIECE_ROWS, PIECE_BYTES
from .plans import RoutingPlan, plan_piece
from .work import Work


def piece_rows(row_bytes: int) -> int:
    """Grouped rows per piece when one row's up projection takes `row_bytes` (tutel.rules.lines)."""
    return max(MIN_PIECE_ROWS, PIECE_BYTES // max(1, row_bytes))


def combine_without_grad(x: torch.Tensor, weights: Optional[torch.Tensor], plan: RoutingPlan,
                         products: Callable[[torch.Tensor, RoutingPlan], torch.Tensor], rows_per_piece: int
                         ) -> torch.Tensor:
    """The routing-weighted sum of every token's expert outputs, on CPU with nothing to differentiate.

    ``products(rows, plan)`` maps [n, H] rows grouped by expert as `plan` says to their [n, O]
    expert outputs; only the kept rows (ids inside [0, E), sorted first) run.  Up to
    `rows_per_piece` of them are copied into grouped rows and combined at once; more run in pieces
    (_run_in_pieces).  Returns [T, O]: in the products' dtype, float32 for 16-bit ones in pieces."""
    kept = int(plan.offsets[-1])  # the group ends, on the CPU: no synchronisation
    if kept > rows_per_piece:
        return _run_in_pieces(x, weights, plan, kept, rows_per_piece, products)
    # Capacity `kept`: the dropped choices (slot N = T*k) stay out of the grouped rows.
    rows = direct.scatter_slots(x, plan.indices, plan.locations, kept)
    out = products(rows.view(kept, x.shape[1]), plan_piece(plan, 0, kept))
    # The [T, k] weights read in place as [k, T], whatever their floating dtype.
    gates = None if weights is None else weights.t()
    return direct.gather_slots(out.view(1, kept, out.shape[-1]), plan.indices, plan.locations, gates)


def _run_in_pieces(x: torch.Tensor, weights: Optional[torch.Tensor], plan: RoutingPlan, kept: int, piece: int,
                   products: Callable[[torch.Tensor, RoutingPlan], torch.Tensor]) -> torch.Tensor:
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
        part = products(direct.select_rows(x, tokens[start:end]), plan_piece(plan, start, end))
        if y is None:
            y = torch.zeros((x.shape[0], part.shape[1]), dtype=accumulation_dtype(part.dtype), device=x.device)
        part = part.to(y.dtype)
        if slot_weights is not None:
            part.mul_(slot_weights[start:end].to(y.dtype).unsqueeze(1))
        y.index_add_(0, tokens[start:end], part)
    return y


def products_in_pieces(work: Work) -> None:
    """combine_without_grad over the sorted plan: the combined [T, O] result."""
    products, row_bytes = work.experts.grouped_products(work.dtype)
    work.y = combine_without_grad(work.x.to(work.dtype), work.weights, work.plan, products, piece_rows(row_bytes))
    work.features = (work.y.shape[1],)
