"""Tutel's slot layout: every expert's C slots in an [E, C, M] buffer, the tokens encoded into it
and decoded back from it as Tutel's crit tuple describes (``fast_encode`` / ``fast_decode``, Tutel's
API, and the padded and expert-parallel paths' prepare and finalize stages)."""
from typing import Tuple

import torch

from .. import ops
from ..ops.checks import as_slot_tensor, require_floating, require_int

# Tutel's dispatch kernels skip a choice whose expert index is negative, and
# DeepSpeed's gates mark the tokens they drop that way (index -1, location 0,
# gate 0).  The operators know one "dropped" marker only, location >= capacity,
# so such a choice is moved to expert 0 at a location no capacity reaches.
_UNREACHABLE_LOCATION = torch.iinfo(torch.int32).max


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
    return ops.decode(as_expert_buffer(data, num_experts, capacity, "tutel.moe.fast_decode"), indices, locations,
                      gates=gates_s if is_postscore else None)


def as_expert_buffer(data: torch.Tensor, num_experts: int, capacity: int, where: str) -> torch.Tensor:
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
