"""The cache of large CPU buffers behind tutel's CPU operators.

The operators' outputs of 1 MiB and more (dispatched rows, expert products, quantized expert
products, gated units and their gradients, expert weight gradients) take their memory from a cache
of blocks and give it back when freed.  Without it, every block over 32 MiB went back to the kernel on free and the
next step faulted its pages in again: about a quarter of a Qwen3-like MoE training step at 2048
tokens on two cores (docs/design.md).  The cache keeps at most a limit of free bytes (by
default a quarter of the machine's memory, or ``TUTEL_HOST_CACHE_BYTES`` read at start; 0 turns
it off), freeing the least recently returned blocks first.
"""
from typing import Dict

from .extension import load_extension


def cached_buffer_stats() -> Dict[str, int]:
    """The cache's counters: ``cached_bytes`` (free, kept), ``live_bytes`` (in tensors now),
    ``hits`` / ``misses`` (requests served from the cache / newly allocated) and ``limit_bytes``."""
    return dict(load_extension()._host_cache_stats())


def release_cached_buffers() -> None:
    """Returns every free cached block to the system (tensors in use keep theirs)."""
    load_extension()._host_cache_release()


def set_cached_buffer_limit(limit_bytes: int) -> None:
    """Keeps at most `limit_bytes` of free blocks (0: none, new buffers come from PyTorch's
    allocator), freeing what lies beyond at once."""
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
        raise ValueError(f"set_cached_buffer_limit: `limit_bytes` must be an int >= 0, got {limit_bytes!r}")
    load_extension()._host_cache_set_limit(limit_bytes)
