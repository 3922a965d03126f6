"""The CUDA backend's functions in the compiled extension, for tutel.cuda and tutel.jit.

These are the extension's private ``_cuda_*`` functions with types and their preconditions; they
exist only in a build with CUDA (``with_cuda()``), and each raises RuntimeError otherwise.  The
public API stays tutel.cuda (queries, data-error checks, the kernel cache) and tutel.jit (users'
own kernels).
"""
from typing import Callable, List, Sequence, Tuple

from .extension import load_extension

_EXTENSION = load_extension()


def with_cuda() -> bool:
    """True if the extension was built with the CUDA operators."""
    return bool(_EXTENSION.with_cuda)


def _cuda_function(name: str) -> Callable:
    """The extension's function `name`; RuntimeError in a build without CUDA, which has none."""
    if not with_cuda():
        raise RuntimeError(f"tutel.ops.cuda_runtime.{name}: tutel was built without CUDA support")
    return getattr(_EXTENSION, "_cuda_" + name)


def set_nvrtc_search_dirs(directories: Sequence[str]) -> None:
    """Makes the CUDA backend look for libnvrtc in `directories` first (tutel.cuda_libraries
    finds them); takes effect at the next time NVRTC is loaded."""
    _cuda_function("set_nvrtc_search_dirs")(list(directories))


def check_errors(device_index: int) -> None:
    """Waits for CUDA device `device_index` and raises the first bad expert index (IndexError) or
    negative location (ValueError) tutel's kernels met there since the last report."""
    _cuda_function("check_errors")(int(device_index))


def kernel_cache_dir() -> str:
    """The directory of the on-disk cache of compiled kernels ('' when disabled)."""
    return _cuda_function("kernel_cache_dir")()


def nvrtc_info() -> Tuple[str, int, int]:
    """(library path, major, minor) of the NVRTC that compiles the kernels, loading it; raises
    RuntimeError explaining how to install NVRTC when it cannot be found."""
    path, major, minor = _cuda_function("nvrtc_info")()
    return str(path), int(major), int(minor)


def user_kernel_function(source: str, function: str, options: Sequence[str], device_index: int) -> int:
    """Compiles `source` with NVRTC and `options` (or finds it in the kernel caches) for CUDA
    device `device_index`, and returns its kernel `function` (a CUfunction, as an integer)."""
    return int(_cuda_function("user_kernel_function")(source, function, list(options), int(device_index)))


def launch_function(function: int, device_index: int, grid: Sequence[int], block: Sequence[int],
                    pointers: List[int], integers: List[int]) -> None:
    """Launches the CUfunction `function` (from user_kernel_function) on PyTorch's current stream
    of device `device_index` with a grid and block of three dimensions each; its arguments are the
    device addresses `pointers`, then the `integers`, each in a 64-bit slot."""
    _cuda_function("launch_function")(function, device_index, list(grid), list(block), pointers, integers)


__all__ = ["check_errors", "kernel_cache_dir", "launch_function", "nvrtc_info", "set_nvrtc_search_dirs",
           "user_kernel_function", "with_cuda"]
