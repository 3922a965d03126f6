"""tutel's CUDA backend from Python: availability, data-error checks, kernel cache.

The CUDA operators check the expert indices and locations they are given
without synchronising the GPU with the host: a bad entry is treated as a
dropped choice and reported at the start of the next tutel CUDA operator on
that device, or at once by :func:`check_errors`.  See docs/cuda-backend.md.
"""
from typing import Dict, Optional, Tuple, Union

import torch

from .cuda_libraries import nvrtc_search_dirs
from .ops import backend as _backend, cuda_runtime

_NOT_BUILT = (
    "tutel was built without CUDA support (the installed PyTorch was a CPU build, or "
    "TUTEL_WITH_CUDA=0). Reinstall it with a CUDA build of PyTorch and a CUDA toolkit "
    "(CUDA_HOME) present: pip install --no-build-isolation ."
)


def is_built() -> bool:
    """True if the extension contains the CUDA operators."""
    return cuda_runtime.with_cuda()


def is_available() -> bool:
    """True if the CUDA operators are built and PyTorch sees a CUDA device."""
    return is_built() and torch.cuda.is_available()


def require_built(where: str) -> None:
    """Raises RuntimeError naming `where` when the CUDA operators were not built."""
    if not is_built():
        raise RuntimeError(f"{where}: CUDA support is disabled during Tutel installation. {_NOT_BUILT}")


def _device_index(device: Optional[Union[int, str, torch.device]]) -> int:
    if device is None:
        return torch.cuda.current_device()
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        raise ValueError(f"tutel.cuda: expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def check_errors(device: Optional[Union[int, str, torch.device]] = None) -> None:
    """Waits for the device and raises the first bad expert index (IndexError) or
    negative location (ValueError) that tutel's kernels met since the last report."""
    require_built("tutel.cuda.check_errors")
    cuda_runtime.check_errors(_device_index(device))


def kernel_cache_dir() -> str:
    """The on-disk cache of compiled kernels ('' when disabled with TUTEL_KERNEL_CACHE=off)."""
    require_built("tutel.cuda.kernel_cache_dir")
    return cuda_runtime.kernel_cache_dir()


def nvrtc_info() -> Tuple[str, int, int]:
    """(library path, major, minor) of the NVRTC that compiles the kernels; raises
    RuntimeError explaining how to install NVRTC when it cannot be found."""
    require_built("tutel.cuda.nvrtc_info")
    return cuda_runtime.nvrtc_info()


def _torch_cuda_major() -> Optional[int]:
    version = torch.version.cuda
    return int(version.split(".")[0]) if version else None


if is_built():
    cuda_runtime.set_nvrtc_search_dirs(nvrtc_search_dirs(_torch_cuda_major()))


def operator_backends() -> Dict[str, Dict[str, Tuple[str, str]]]:
    """For each CUDA device tutel's operators have run on: {device: {operator:
    (implementation, reason)}}, the implementation being "nvrtc" (the compiled
    kernels) or "composite" (plain PyTorch operations); see docs/cuda-backend.md."""
    return {device: {name: tuple(choice) for name, choice in choices.items()}
            for device, choices in _backend.CUDA_BACKENDS.choices().items()}
