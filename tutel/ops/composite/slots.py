"""gather_slots and scatter_slots (encode / decode and their backward passes) as PyTorch operations.

The arithmetic follows csrc/core/dispatch.cpp step by step so that the data
results are bit for bit the compiled operators' (up to which NaN a NaN is):
rows are weighted and summed in choice order in the accumulation dtype and
rounded once (the first kept row starts the sum); a slot named by several
choices is built by adding their weighted rows in (choice, token) order,
rounding after each addition, and once one slot is shared every slot is built
that way.  (The compiled operators copy a single row of weight one instead of
multiplying it by one, which gives the same value.)
"""
from typing import Optional, Tuple

import torch

from ..checks import accumulation_dtype
from .entries import raise_bad_entry
from .grouping import rank_in_group


_FLOATING = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_arguments(op: str, data: torch.Tensor, data_name: str, data_dim: int, indices: Optional[torch.Tensor],
                     locations: torch.Tensor, weights: Optional[torch.Tensor], other: Optional[torch.Tensor],
                     other_shape: Tuple[int, ...]) -> None:
    """The compiled operators' argument checks (csrc/ops/op_args.cpp), with their exception types."""
    where = f"tutel::{op}"
    if data.dim() != data_dim:
        raise ValueError(f"{where}: `{data_name}` must be {data_dim}-D, got shape {tuple(data.shape)}")
    if data.dtype not in _FLOATING:
        raise TypeError(f"{where}: `{data_name}` must be float32, float64, bfloat16 or float16, got {data.dtype}")
    tables = (("locations", locations),) if indices is None else (("indices", indices), ("locations", locations))
    for name, table in tables:
        if table.dtype != torch.int32:
            raise TypeError(f"{where}: `{name}` must have dtype torch.int32, got {table.dtype}")
        if table.device != data.device:
            raise ValueError(f"{where}: `{name}` is on {table.device} but the data is on {data.device}")
    if indices is None and locations.dim() != 2:
        raise ValueError(f"{where}: `locations` must be 2-D, got shape {tuple(locations.shape)}")
    if indices is not None and (indices.dim() != 2 or indices.shape != locations.shape):
        raise ValueError(f"{where}: `indices` and `locations` must have the same shape [k, tokens], got "
                         f"{tuple(indices.shape)} and {tuple(locations.shape)}")
    if weights is not None:
        if weights.dtype not in _FLOATING:
            raise TypeError(f"{where}: `weights` must be float32, float64, bfloat16 or float16, got {weights.dtype}")
        if weights.shape != locations.shape or weights.device != data.device:
            raise ValueError(f"{where}: `weights` must be a {tuple(locations.shape)} tensor on {data.device}, got "
                             f"{tuple(weights.shape)} on {weights.device}")
    if other is not None:
        if other.dtype != data.dtype:
            raise TypeError(f"{where}: `other` must have dtype {data.dtype}, got {other.dtype}")
        if tuple(other.shape) != tuple(other_shape) or other.device != data.device:
            raise ValueError(f"{where}: `other` must have shape {tuple(other_shape)} on {data.device}, got "
                             f"{tuple(other.shape)} on {other.device}")


def _kept_slots(op: str, indices: torch.Tensor, locations: torch.Tensor, experts: int,
                capacity: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(kept [k, T] bool, slot [k, T] int64 row of the [E * C, M] buffer, 0 where dropped).
    Bad entries raise; where they cannot be checked they are dropped, as the CUDA kernels do."""
    raise_bad_entry(op, indices, experts, locations)
    kept = (locations < capacity) & (locations >= 0) & (indices >= 0) & (indices < experts)
    slot = torch.where(kept, indices.long() * capacity + locations.long(), torch.zeros_like(indices, dtype=torch.long))
    return kept, slot


def _grouped_table(indices: Optional[torch.Tensor], locations: torch.Tensor) -> torch.Tensor:
    """`indices`, or for None (the grouped layout: every choice names expert 0) a table of zeros."""
    return torch.zeros_like(locations) if indices is None else indices


def _weights_in(weights: Optional[torch.Tensor], acc: torch.dtype) -> Optional[torch.Tensor]:
    """The weights (any floating dtype and strides) in the accumulation dtype, as the kernels
    convert each one when they read it (float64 to float32 rounding to nearest)."""
    return None if weights is None else weights.to(acc)


def _dots_output(indices: torch.Tensor, other: Optional[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    shape = tuple(indices.shape) if other is not None else (0,)
    return torch.zeros(shape, dtype=acc, device=indices.device)


def _dot_rows(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    return (a.to(acc) * b.to(acc)).sum(-1)


def gather_slots(rows: torch.Tensor, indices: Optional[torch.Tensor], locations: torch.Tensor,
                 weights: Optional[torch.Tensor], other: Optional[torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """out[t] = sum over kept choices j of weights[j, t] * rows[indices[j, t], locations[j, t]]
    (zeros when every choice of t was dropped); dots[j, t] = <that row, other[t]> when
    `other` [T, M] is given (0 for dropped choices), else an empty tensor.

    rows [E, C, M]; indices, locations [k, T] int32 (indices None: every choice names expert 0);
    weights [k, T] of any floating dtype and strides, or None (weight 1).
    """
    _check_arguments("gather_slots", rows, "rows", 3, indices, locations, weights, other,
                     (locations.shape[-1], rows.shape[-1]) if rows.dim() == 3 else ())
    indices = _grouped_table(indices, locations)
    experts, capacity, model_dim = rows.shape
    k, tokens = indices.shape
    acc = accumulation_dtype(rows.dtype)
    weights = _weights_in(weights, acc)
    kept, slot = _kept_slots("gather_slots", indices, locations, experts, capacity)
    dots = _dots_output(indices, other, acc)
    out = torch.zeros((tokens, model_dim), dtype=rows.dtype, device=rows.device)
    if experts * capacity == 0 or tokens == 0:
        return out, dots  # nothing can be kept
    table = rows.reshape(experts * capacity, model_dim)
    total = torch.zeros((tokens, model_dim), dtype=acc, device=rows.device)
    started = torch.zeros(tokens, dtype=torch.bool, device=rows.device)
    for j in range(k):
        row = table.index_select(0, slot[j])
        term = row.to(acc) if weights is None else row.to(acc) * weights[j].unsqueeze(1)
        # The first kept row starts the sum (no 0 + term, which would turn -0 into +0).
        summed = torch.where(started.unsqueeze(1), total + term, term)
        total = torch.where(kept[j].unsqueeze(1), summed, total)
        started = started | kept[j]
        if other is not None:
            dots[j] = torch.where(kept[j], _dot_rows(row, other, acc), dots.new_zeros(()))
    out = torch.where(started.unsqueeze(1), total.to(rows.dtype), out)
    return out, dots


def scatter_slots(src: torch.Tensor, indices: Optional[torch.Tensor], locations: torch.Tensor,
                  weights: Optional[torch.Tensor], other: Optional[torch.Tensor],
                  num_experts: int, capacity: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """out[indices[j, t], locations[j, t]] = weights[j, t] * src[t] for kept choices in a
    zeroed [E, C, M] buffer (several choices naming one slot are summed in (choice,
    token) order); dots[j, t] = <other[slot], src[t]> when `other` [E, C, M] is given.

    src [T, M]; indices, locations [k, T] int32 (indices None: every choice names expert 0;
    shared slots are still summed here, as on the CPU); weights [k, T] of any floating dtype and
    strides, or None (weight 1).
    """
    _check_arguments("scatter_slots", src, "src", 2, indices, locations, weights, other,
                     (num_experts, capacity, src.shape[-1]) if src.dim() == 2 else ())
    indices = _grouped_table(indices, locations)
    if num_experts < 1 or capacity < 0:
        raise ValueError(f"tutel::scatter_slots: num_experts must be >= 1 and capacity >= 0, got {num_experts} "
                         f"and {capacity}")
    if src.shape[0] != indices.shape[1]:
        raise ValueError(f"tutel::scatter_slots: `src` has {src.shape[0]} rows but `indices` describes "
                         f"{indices.shape[1]} tokens")
    tokens, model_dim = src.shape
    acc = accumulation_dtype(src.dtype)
    weights = _weights_in(weights, acc)
    slots = num_experts * capacity
    kept, slot = _kept_slots("scatter_slots", indices, locations, num_experts, capacity)
    dots = _dots_output(indices, other, acc)
    out = torch.zeros((slots, model_dim), dtype=src.dtype, device=src.device)
    entries = kept.flatten().nonzero().squeeze(1)  # kept entries in (choice, token) order
    entry_slots = slot.flatten().index_select(0, entries)
    entry_rows = src.index_select(0, entries % max(tokens, 1))
    entry_weights = None if weights is None else weights.flatten().index_select(0, entries)
    if other is not None and entries.numel() > 0:
        other_rows = other.reshape(slots, model_dim).index_select(0, entry_slots)
        dots.view(-1)[entries] = _dot_rows(entry_rows, other_rows, acc)
    rank, slot_sizes = rank_in_group(entry_slots, slots)
    if entries.numel() == 0 or int(slot_sizes.max()) <= 1:
        weighted = entry_rows if entry_weights is None else (
            (entry_rows.to(acc) * entry_weights.unsqueeze(1)).to(src.dtype))
        out[entry_slots] = weighted
        return out.view(num_experts, capacity, model_dim), dots
    # Some slot is shared: every slot adds its rows one at a time, rounding each sum.
    for step in range(int(slot_sizes.max())):
        now = (rank == step).nonzero().squeeze(1)
        targets = entry_slots.index_select(0, now)
        term = entry_rows.index_select(0, now).to(acc)
        if entry_weights is not None:
            term = term * entry_weights.index_select(0, now).unsqueeze(1)
        out[targets] = (out.index_select(0, targets).to(acc) + term).to(src.dtype)
    return out.view(num_experts, capacity, model_dim), dots
