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


def _any_autocast_by_device() -> bool:
    return autocast_dtype("cpu") is not None or autocast_dtype("cuda") is not None


# Whether autocast is on for any device: one C call where PyTorch has it (a call's fast check before
# asking for its own device's dtype).
any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or _any_autocast_by_device


_NOTHING = contextlib.nullcontext()  # (reusable: it holds no state)


def without_autocast(device_type: str):
    """Context in which autocast is off for `device_type` (routing runs in full precision)."""
    if not any_autocast():  # already off everywhere: entering and leaving torch.autocast would cost a call's routing
        return _NOTHING
    if device_type in ("cpu", "cuda", "xpu", "hpu"):
        return torch.autocast(device_type=device_type, enabled=False)
    return _NOTHING
