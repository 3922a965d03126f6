"""Whether torch.compile is tracing the current call, on every supported PyTorch."""
import torch


def is_compiling() -> bool:
    """True while torch.compile (Dynamo) traces; False on PyTorch versions without it."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())
