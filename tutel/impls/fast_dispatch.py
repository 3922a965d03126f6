"""Tutel's routing API: extract_critical (top_k_routing), fast_encode / fast_decode
and the TutelMoeFastDispatcher object used by DeepSpeed and fairseq.

``crit`` is the tuple ``(num_global_experts, indices_s, locations_s, gates_s,
capacity, dispatch_count)`` exactly as in Tutel: lists of k int32 / float [T]
tensors, a Python int capacity and an [E] int64 count of routed choices per
expert (before capacity truncation).
"""
import logging
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from .. import ops
from ..ops.checks import (
    as_slot_tensor,
    require_dim,
    require_finite_number,
    require_floating,
    require_int,
    require_top_k,
    stack_choices,
)
from ..ops.routing import route_topk_unchecked
from ..ops.tracing import is_compiling
from ..paths.plans import choice_rows
from . import losses
from ..rules.capacity import expert_capacity, realtime_capacity_factor
from ..collectives import all_reduce_max_int, get_world_rank

logger = logging.getLogger("tutel")

# Tutel's dispatch kernels skip a choice whose expert index is negative, and
# DeepSpeed's gates mark the tokens they drop that way (index -1, location 0,
# gate 0).  The operators know one "dropped" marker only, location >= capacity,
# so such a choice is moved to expert 0 at a location no capacity reaches.
_UNREACHABLE_LOCATION = torch.iinfo(torch.int32).max


class CriticalData(NamedTuple):
    """Routing metadata of one MoE call; unpacks and indexes like Tutel's crit tuple."""

    num_global_experts: int
    indices_s: List[torch.Tensor]    # k x [T] int32
    locations_s: List[torch.Tensor]  # k x [T] int32
    gates_s: List[torch.Tensor]      # k x [T] floating
    capacity: int
    dispatch_count: torch.Tensor     # [E] int64


def normalize_gates(gates: torch.Tensor) -> torch.Tensor:
    """Rescales the k gate values of every token ([k, T]) to sum to one (clamped at eps)."""
    denominator = torch.clamp(gates.sum(dim=0), min=torch.finfo(gates.dtype).eps)
    return gates / denominator


def extract_critical(scores: torch.Tensor, top_k: int, loss_fn: Optional[Callable] = losses.gshard_loss,
                     capacity_factor: float = 1.0, batch_prioritized_routing: bool = False,
                     normalize_gate: bool = True, alignment: int = 1, group=None,
                     inequivalent_tokens: bool = False,
                     gate_values: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                     ) -> Tuple[CriticalData, Optional[torch.Tensor]]:
    """Top-k routing of T tokens over E experts (Tutel's ``top_k_routing``).

    Args:
        scores: [T, E] routing probabilities (softmax of the gate logits).
        top_k: experts per token, 1 <= top_k <= E.
        loss_fn: ``loss_fn(scores, topk_ids [T, k] int64)`` for the auxiliary
            loss, or None.
        capacity_factor: > 0 static capacity, 0 dropless, < 0 dynamic capped
            capacity (see tutel.rules.capacity.expert_capacity).
        batch_prioritized_routing: tokens with higher top-1 scores claim slots first.
        normalize_gate: for k > 1, rescale each token's k gates to sum to 1.
        alignment: round the capacity up to a multiple of this.
        group: process group over which dynamic capacities (and, with
            ``inequivalent_tokens``, token counts) are agreed.
        inequivalent_tokens: ranks may hold different token counts; the
            static capacity then uses the largest count in the group.
        gate_values: ``gate_values(indices [k, T] int32) -> [k, T]`` weights of the chosen experts,
            replacing the chosen scores (and ``normalize_gate``): then `scores` only choose the
            experts (scored routing, tutel.impls.scored_routing).

    Returns:
        (crit, l_aux) where crit is a CriticalData tuple and l_aux the loss
        (None when loss_fn is None).
    """
    where = "tutel.moe.top_k_routing"
    require_floating(scores, "scores", where)
    require_dim(scores, 2, "scores", where)
    top_k = require_top_k(top_k, int(scores.shape[1]), where)
    capacity_factor = require_finite_number(capacity_factor, "capacity_factor", where)
    alignment = require_int(alignment, "alignment", where, minimum=1)
    return route_critical(scores, top_k, loss_fn, capacity_factor, batch_prioritized_routing, normalize_gate,
                          alignment, group, inequivalent_tokens, gate_values)


def route_critical(scores: torch.Tensor, top_k: int, loss_fn: Optional[Callable] = losses.gshard_loss,
                   capacity_factor: float = 1.0, batch_prioritized_routing: bool = False,
                   normalize_gate: bool = True, alignment: int = 1, group=None,
                   inequivalent_tokens: bool = False,
                   gate_values: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   capacity: Optional[int] = None) -> Tuple[CriticalData, Optional[torch.Tensor]]:
    """extract_critical for arguments the caller has validated already (the MoE layer checks its
    call's switches once, in tutel.impls.call_settings), with the static capacity when the caller
    has it (capacity_factor > 0 and the same token count on every process), else None."""
    num_tokens, num_experts = int(scores.shape[0]), int(scores.shape[1])
    routing = route_topk_unchecked(scores, top_k, bool(batch_prioritized_routing))
    if loss_fn is losses.gshard_loss:  # the operator counted the first choices already
        l_aux = losses.gshard_loss_from_counts(scores, routing.counts[0])
    else:
        l_aux = loss_fn(scores, routing.indices.t().long()) if loss_fn is not None else None
    if gate_values is not None:
        gates = gate_values(routing.indices)
    else:
        gates = normalize_gates(routing.gates) if (top_k > 1 and normalize_gate) else routing.gates
    dispatch_count = routing.counts.sum(dim=0)

    if inequivalent_tokens:
        num_tokens = all_reduce_max_int(num_tokens, scores.device, group)
    if capacity is None:
        capacity = expert_capacity(
            capacity_factor, top_k, num_tokens, num_experts,
            max_load=lambda: all_reduce_max_int(int(dispatch_count.max()), scores.device, group),
            alignment=alignment)

    if not is_compiling() and logger.isEnabledFor(logging.INFO) and get_world_rank(group) == 0:
        logger.info("Capacity = %d, real-time capacity-factor for top-%d = %s", capacity, top_k,
                    realtime_capacity_factor(capacity, top_k, num_tokens, num_experts))

    crit = CriticalData(num_experts, *choice_rows(routing.indices, routing.locations, gates), capacity,
                        dispatch_count)
    return crit, l_aux


def tutel_slot_table(indices_, locations_, where: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """int32 [k, T] (indices, locations) from Tutel-style lists of k [T] tensors (or [k, T] tensors).

    A negative expert index marks a choice that is not dispatched (as in Tutel);
    it reads and writes nothing and gets no gate gradient, like a choice whose
    location is >= capacity.
    """
    indices = as_slot_tensor(indices_, "indices_", where)
    locations = as_slot_tensor(locations_, "locations_", where)
    if indices.shape != locations.shape:
        raise ValueError(f"{where}: `indices_` and `locations_` must describe the same [k, tokens] choices, "
                         f"got shapes {tuple(indices.shape)} and {tuple(locations.shape)}")
    not_dispatched = indices < 0
    return indices.clamp(min=0), torch.where(not_dispatched, _UNREACHABLE_LOCATION, locations)


def get_dispatch_count(critical_data) -> torch.Tensor:
    """Per-expert routed-choice counts of a crit tuple (before capacity truncation)."""
    return critical_data[-1]


def fast_encode(data: torch.Tensor, critical_data, is_postscore: bool = True) -> torch.Tensor:
    """Dispatches [T, M] tokens into the [E, C, M] expert buffer described by ``critical_data``.

    With ``is_postscore=False`` the gates are applied here; otherwise at decode.
    """
    # unpacked, not sliced (critical_data[:5]): PyTorch 2.6's torch.compile fails on a named tuple's slice
    num_experts, indices_s, locations_s, gates_s, capacity, *_ = critical_data
    indices, locations = tutel_slot_table(indices_s, locations_s, "tutel.moe.fast_encode")
    data = data.reshape(-1, data.shape[-1]) if data.dim() > 2 else data
    return ops.encode(data, indices, locations, num_experts, capacity,
                      gates=None if is_postscore else gates_s)


def fast_decode(data: torch.Tensor, critical_data, is_postscore: bool = True) -> torch.Tensor:
    """Combines an [E, C, M] (or [E*C, M]) expert buffer back into [T, M] tokens.

    With ``is_postscore=True`` (default) the gates weight the expert outputs here.
    """
    num_experts, indices_s, locations_s, gates_s, capacity, *_ = critical_data
    indices, locations = tutel_slot_table(indices_s, locations_s, "tutel.moe.fast_decode")
    capacity = require_int(capacity, "capacity", "tutel.moe.fast_decode")
    return ops.decode(_as_expert_buffer(data, num_experts, capacity, "tutel.moe.fast_decode"), indices, locations,
                      gates=gates_s if is_postscore else None)


def _as_expert_buffer(data: torch.Tensor, num_experts: int, capacity: int, where: str) -> torch.Tensor:
    """`data` as the [E, C, M] buffer of the routing (E experts, C slots each).

    Accepts [E, C, M] or the flat [E*C, M]; any other shape raises naming both the buffer's
    shape and the routing's experts and capacity (a buffer whose rows merely divide by E would
    otherwise be reshaped to the wrong capacity)."""
    require_floating(data, "data", where)
    expected = (num_experts, capacity)
    if data.dim() == 3:
        fits = tuple(data.shape[:2]) == expected
    elif data.dim() == 2:
        fits = data.shape[0] == num_experts * capacity
    else:
        fits = False
    if not fits:
        raise ValueError(f"{where}: `data` of shape {tuple(data.shape)} is not the routing's expert buffer: the "
                         f"routing has num_global_experts={num_experts} and capacity={capacity}, so `data` must be "
                         f"[{num_experts}, {capacity}, M] or [{num_experts * capacity}, M]")
    return data.reshape(num_experts, capacity, data.shape[-1])


class TutelMoeFastDispatcher:
    """Stateful encode/decode object (the API DeepSpeed and fairseq call).

    ``update()`` stores the routing of the current batch; ``encode(x)`` returns
    the [E*C, M] dispatched buffer and ``decode(y)`` the [T, M'] combined tokens.
    Data is computed in ``dispatch_dtype`` (float64 stays float64).
    """

    def __init__(self, num_global_experts: int, capacity: int, model_dim: int, dispatch_dtype: torch.dtype):
        where = "tutel.moe.fast_dispatcher"
        self.num_global_experts = require_int(num_global_experts, "num_global_experts", where, minimum=1)
        self.capacity = require_int(capacity, "capacity", where, minimum=0)
        self.model_dim = require_int(model_dim, "model_dim", where, minimum=1)
        self.dtype = dispatch_dtype
        self.original_dtype = dispatch_dtype
        self.is_postscore = True

    def update(self, indices_, locations_, gates_, capacity=None, is_postscore: bool = True) -> None:
        """Sets the routing: lists of k [T] tensors (or [k, T] tensors) of expert ids, slots and gates.

        A negative expert id marks a choice that is not dispatched (DeepSpeed passes -1
        for the tokens its gate drops).  ``capacity`` may be an int or a 0-d tensor.
        """
        where = "tutel.moe.fast_dispatcher.update"
        self.indices_, self.locations_ = tutel_slot_table(indices_, locations_, where)
        self.gates_ = stack_choices(gates_, "gates_", where)
        if capacity is not None:
            capacity = require_int(capacity, "capacity", where, minimum=0)
            self.capacity = capacity or self.capacity
        self.is_postscore = is_postscore
        self.sample_size = int(self.indices_.shape[1])

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        data = data.to(self.dtype)
        data = data.reshape(-1, data.shape[-1]) if data.dim() > 2 else data
        out = ops.encode(data, self.indices_, self.locations_, self.num_global_experts, self.capacity,
                         gates=None if self.is_postscore else self.gates_)
        return out.reshape(-1, out.shape[-1]).to(self.original_dtype)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        buffer = _as_expert_buffer(data.to(self.dtype), self.num_global_experts, self.capacity,
                                   "tutel.moe.fast_dispatcher.decode")
        out = ops.decode(buffer, self.indices_, self.locations_, gates=self.gates_ if self.is_postscore else None)
        return out.to(self.original_dtype)


fast_dispatcher = TutelMoeFastDispatcher


class GatingEncoder:
    """``GatingEncoder.apply(dispatcher, x, *gates)``: encode with the dispatcher's routing
    (gates given explicitly are applied at encode time).  Differentiable."""

    @staticmethod
    def apply(config: TutelMoeFastDispatcher, reshaped_input: torch.Tensor, *gates_) -> torch.Tensor:
        out = ops.encode(reshaped_input, config.indices_, config.locations_, config.num_global_experts,
                         config.capacity, gates=list(gates_) if gates_ else None)
        return out.reshape(-1, out.shape[-1])


class GatingDecoder:
    """``GatingDecoder.apply(dispatcher, y, *gates)``: decode with the dispatcher's routing
    (gates given explicitly weight the expert outputs).  Differentiable."""

    @staticmethod
    def apply(config: TutelMoeFastDispatcher, expert_output: torch.Tensor, *gates_) -> torch.Tensor:
        buffer = _as_expert_buffer(expert_output, config.num_global_experts, config.capacity,
                                   "tutel GatingDecoder")
        return ops.decode(buffer, config.indices_, config.locations_, gates=list(gates_) if gates_ else None)


def compute_sorted_location(x: torch.Tensor, importance_scores: torch.Tensor) -> torch.Tensor:
    """Slot matrix of a [T, E] one-hot mask when tokens claim slots in ascending
    order of ``importance_scores`` (Tutel's batch-prioritized helper)."""
    order = torch.argsort(importance_scores, dim=0, stable=True)
    sorted_x = x[order]
    sorted_locations = ops.cumsum_sub_one(sorted_x) * sorted_x
    return sorted_locations[torch.argsort(order, dim=0)]
