"""How one expert parameter is stored on a process, and how to take it apart and put it together.

A process stores either L whole experts or, when S processes share an expert, one slice of
it.  Three layouts cover the built-in experts:

* ``RowSlices`` -- stored ``[L, rows, ...]``; a shared expert is split into S equal blocks of
  rows.  ffn's ``batched_fc1_w [L, H/S, M]``, ``batched_fc2_w [L, H/S, O]`` and
  ``batched_fc1_bias [L, H/S]``, and any multi-dim parameter of a custom expert.
* ``PaddedSlices`` -- stored ``[L, ceil(O/S)]``; the expert's O values are padded with zeros
  to S * ceil(O/S) and split in S.  ffn's ``batched_fc2_bias``.
* ``FlatSlices`` -- stored 1-D: the L experts' flattened values one after the other, or for
  a shared expert one of S pieces of ceil(P/S) values (the last one padded), P being the
  expert's size.  llama_ffn's ``W_fc1``, ``W_fc2``, ``W_fc3``, and any 1-D custom parameter.

Every method is exact (views, concatenation and zero padding): resharding never rounds.
"""
import math
from typing import List, Optional, Tuple

import torch


class ShapeError(ValueError):
    """A stored tensor does not have the shape its layout and placement require."""


class RowSlices:
    """Stored [L, rows, ...]; one expert is [rows_total, ...]; slices are blocks of rows."""

    name = "row slices"

    def split_experts(self, stored: torch.Tensor, local_experts: int, what: str) -> List[torch.Tensor]:
        if stored.dim() < 1 or stored.shape[0] != local_experts:
            raise ShapeError(f"{what}: shape {tuple(stored.shape)} should hold {local_experts} expert(s) "
                             f"along dim 0")
        return list(stored.unbind(0))

    def stack_experts(self, experts: List[torch.Tensor]) -> torch.Tensor:
        return torch.stack(experts, dim=0)

    def join_slices(self, pieces: List[torch.Tensor], full_size: Optional[int], what: str) -> torch.Tensor:
        self._check_shared(pieces, what)
        return torch.cat([piece[0] for piece in pieces], dim=0)

    def cut_slice(self, expert: torch.Tensor, shares: int, index: int, what: str) -> torch.Tensor:
        rows = expert.shape[0]
        if rows % shares != 0:
            raise ShapeError(f"{what}: {rows} rows of shape {tuple(expert.shape)} cannot be split evenly over "
                             f"{shares} processes sharing the expert")
        size = rows // shares
        return expert[index * size:(index + 1) * size].unsqueeze(0)

    def global_shape(self, local_shape, placement, full_size: Optional[int]) -> Tuple[int, ...]:
        """Shape of the parameter in a one-process checkpoint holding all experts."""
        return (placement.num_experts, local_shape[1] * placement.sharded_count) + tuple(local_shape[2:])

    @staticmethod
    def _check_shared(pieces, what):
        for piece in pieces:
            if piece.dim() < 1 or piece.shape[0] != 1:
                raise ShapeError(f"{what}: a slice of a shared expert should have shape [1, ...], got "
                                 f"{tuple(piece.shape)}")


class PaddedSlices(RowSlices):
    """Stored [L, ceil(O/S)]; one expert is [O]; slices are zero-padded blocks."""

    name = "padded slices"

    def join_slices(self, pieces, full_size, what):
        joined = super().join_slices(pieces, full_size, what)
        if full_size is None:
            raise ShapeError(f"{what}: the full size of the expert is unknown, so its padding cannot be removed")
        if -(-full_size // len(pieces)) != len(pieces[0][0]):
            raise ShapeError(f"{what}: {len(pieces)} slices of {len(pieces[0][0])} values cannot hold "
                             f"{full_size} values")
        return joined[:full_size]

    def cut_slice(self, expert, shares, index, what):
        width = -(-expert.shape[0] // shares)
        padded = expert.new_zeros((width * shares,) + tuple(expert.shape[1:]))
        padded[:expert.shape[0]] = expert
        return padded[index * width:(index + 1) * width].unsqueeze(0)

    def global_shape(self, local_shape, placement, full_size):
        if full_size is None:
            full_size = local_shape[1] * placement.sharded_count
        return (placement.num_experts, full_size)


class FlatSlices:
    """Stored 1-D; one expert is its P flattened values; slices are pieces of ceil(P/S) values."""

    name = "flat slices"

    def split_experts(self, stored, local_experts, what):
        if stored.dim() != 1 or stored.numel() % local_experts != 0:
            raise ShapeError(f"{what}: shape {tuple(stored.shape)} should be 1-D and hold {local_experts} "
                             f"expert(s) of equal size")
        return list(stored.view(local_experts, -1).unbind(0))

    def stack_experts(self, experts):
        return torch.cat(experts, dim=0)

    def join_slices(self, pieces, full_size, what):
        for piece in pieces:
            if piece.dim() != 1:
                raise ShapeError(f"{what}: a slice of a shared expert should be 1-D, got {tuple(piece.shape)}")
        joined = torch.cat(pieces, dim=0)
        if full_size is None:
            return joined
        if -(-full_size // len(pieces)) != len(pieces[0]):
            raise ShapeError(f"{what}: {len(pieces)} slices of {len(pieces[0])} values cannot hold an expert of "
                             f"{full_size} values")
        return joined[:full_size]

    def cut_slice(self, expert, shares, index, what):
        width = -(-expert.numel() // shares)
        padded = expert.new_zeros(width * shares)
        padded[:expert.numel()] = expert
        return padded[index * width:(index + 1) * width]

    def global_shape(self, local_shape, placement, full_size):
        if placement.sharded_count == 1:
            full_size = math.prod(local_shape) // placement.local_experts
        elif full_size is None:
            full_size = math.prod(local_shape) * placement.sharded_count
        return (placement.num_experts * full_size,)


ROWS, PADDED, FLAT = RowSlices(), PaddedSlices(), FlatSlices()

# Tutel's built-in experts, by parameter name (the part after "experts.").
_KNOWN = {
    "batched_fc1_w": ROWS, "batched_fc2_w": ROWS, "batched_fc1_bias": ROWS, "batched_fc2_bias": PADDED,
    "W_fc1": FLAT, "W_fc2": FLAT, "W_fc3": FLAT,
}


def layout_of(name: str, stored: torch.Tensor):
    """The layout of expert parameter `name` (the key after ``experts.``): Tutel's names first,
    else by rank: 1-D parameters are flat, others hold experts along dim 0."""
    layout = _KNOWN.get(name)
    if layout is not None and (layout is FLAT) == (stored.dim() == 1):
        return layout
    if stored.dim() == 0:
        raise ShapeError(f"expert parameter `{name}` is a scalar: it cannot be split by expert")
    return FLAT if stored.dim() == 1 else ROWS
