"""tutel: fast, correct Mixture-of-Experts layers for PyTorch.

A drop-in replacement for Microsoft Tutel: ``from tutel import moe`` gives the
same API (``moe.moe_layer``, ``moe.top_k_routing``, ``moe.fast_encode`` ...),
backed by the compiled operators registered under ``torch.ops.tutel``.
"""
import torch  # noqa: F401  (loads libc10 / libtorch, which tutel._C links against without an rpath)

from .torch_versions import check_supported as _check_supported_torch

_check_supported_torch()  # before the extension: an older PyTorch gets the range, not a loader error

from ._version import __version__  # noqa: E402
from . import ops as _ops  # noqa: E402,F401  (loads the compiled extension first: tutel.ops reaches it)
from . import cuda as _cuda  # noqa: E402,F401  (tells the CUDA backend where NVRTC lives)

__all__ = ["__version__"]
