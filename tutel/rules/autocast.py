"""Autocast queries that work across the supported PyTorch versions."""
import contextlib
from typing import Optional

import torch


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype for `device_type` if autocast is enabled there, else None."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # PyTorch < 2.4: separate CPU / GPU queries
        enabled = torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    if not enabled:
        return None
    if hasattr(torch, "get_autocast_dtype"):
        return torch.get_autocast_dtype(device_type)
    return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def without_autocast(device_type: str):
    """Context in which autocast is off for `device_type` (routing runs in full precision)."""
    if device_type in ("cpu", "cuda", "xpu", "hpu"):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()
