"""Tutel-compatible home of ``fast_cumsum_sub_one`` (DeepSpeed imports it from tutel.moe)."""
from ..ops.cumsum import cumsum_sub_one as fast_cumsum_sub_one

__all__ = ["fast_cumsum_sub_one"]
