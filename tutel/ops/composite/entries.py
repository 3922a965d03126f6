"""Checks of caller-made expert indices and locations, with the compiled operators' errors."""
from typing import Optional

import torch

from ..tracing import is_compiling

def raise_bad_entry(op: str, indices: torch.Tensor, num_experts: int,
                    locations: Optional[torch.Tensor] = None) -> None:
    """Raises for the first bad entry in (choice, token) order, as the CPU operators do:
    IndexError for an expert index outside [0, num_experts), ValueError for a
    negative location.  Reads one flag back from the device; skipped while
    torch.compile traces (the callers then treat bad entries as dropped)."""
    if is_compiling():
        return
    bad_index = (indices < 0) | (indices >= num_experts)
    bad = bad_index if locations is None else bad_index | (locations < 0)
    if bad.numel() == 0 or not bool(bad.any()):
        return
    tokens = indices.shape[1]
    first = int(torch.argmax(bad.flatten().to(torch.uint8)))
    choice, token = divmod(first, tokens)
    if bool(bad_index[choice, token]):
        raise IndexError(f"tutel::{op}: expert index {int(indices[choice, token])} (choice {choice}, token "
                         f"{token}) is out of range; indices must satisfy 0 <= index < num_experts")
    raise ValueError(f"tutel::{op}: location {int(locations[choice, token])} (choice {choice}, token "
                     f"{token}) is negative; locations must be >= 0")
