"""Making every process of an expert group agree on one call's exchange shapes.

The all-to-all only works if every process sends and expects the same sizes.  Those depend
on the capacity (which depends on the local token count, top_k and capacity_factor), on the
overlap degree and on adaptive_r.  If processes disagree, gloo aborts the process and NCCL
hangs (Tutel's issue #173).  One small MAX all-reduce per call settles it: every process
uses the largest capacity (so processes holding different numbers of tokens just work, as
with ``inequivalent_tokens=True``), and a disagreement on the overlap degree or adaptive_r
raises a ValueError on every process instead of crashing.  The settings are host integers and
travel as a CPU tensor (``all_reduce_max_ints``: the group's CPU backend, or a gloo group over
its processes), so the agreement waits for no device and a call with a static capacity can be
captured in a CUDA graph.

Set TUTEL_ASSUME_CONSISTENT_CALLS=1 to skip the collective when every process is known to
make identical calls with equal token counts (the last microseconds); a mismatch is then
undefined behaviour, as in Tutel.
"""
import os

import torch

from ..collectives.simple_collectives import all_reduce_max_ints


def _skip() -> bool:
    return os.environ.get("TUTEL_ASSUME_CONSISTENT_CALLS", "0") not in ("", "0")


def agree_on_call(group, device: torch.device, capacity: int, overlap_degree: int, adaptive_r: int) -> int:
    """Returns the capacity every process of `group` uses for this call (the largest)."""
    if _skip():
        return capacity
    agreed = all_reduce_max_ints([capacity, overlap_degree, -overlap_degree, adaptive_r, -adaptive_r], group, device)
    for name, high, low in (("a2a_ffn_overlap_degree", agreed[1], -agreed[2]), ("adaptive_r", agreed[3], -agreed[4])):
        if high != low:
            raise ValueError(f"moe_layer.forward: the processes of the expert group disagree on {name} for this "
                             f"call (values from {low} to {high}); every process must pass the same {name}")
    return int(agreed[0])
