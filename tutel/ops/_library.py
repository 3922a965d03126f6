"""Compatibility shims over torch.library across the supported PyTorch versions."""
import torch


def register_fake(name):
    """Decorator registering a fake (meta) implementation for the custom op `name`."""
    if hasattr(torch.library, "register_fake"):  # PyTorch >= 2.4
        return torch.library.register_fake(name)
    if hasattr(torch.library, "impl_abstract"):  # PyTorch 2.2 - 2.3
        return torch.library.impl_abstract(name)

    def keep(fn):  # PyTorch 2.1: no tracing support, eager mode only
        return fn

    return keep
