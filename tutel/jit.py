"""``tutel.jit.create_cuda_kernel``: users' own CUDA kernels, compiled by NVRTC.

As in Tutel, the source is a CUDA C++ file with one ``extern "C" __global__``
kernel; ``@key@`` placeholders are replaced from ``keyword_dict`` and the launch
configuration comes from comments such as::

    // [thread_extent] blockIdx.x = 128
    // [thread_extent] threadIdx.x = 256

(``blockIdx``/``threadIdx`` with ``.x``/``.y``/``.z``; a missing extent is 1,
and ``__launch_bounds__(N)`` stands in for a missing ``threadIdx.x``).  The
returned callable takes the CUDA tensors first, then ``extra=[ints]`` (each
passed as a 64-bit integer) and optionally ``blocks=[x, y, z]`` to override
the grid.  Unlike Tutel, the kernel runs on PyTorch's *current* stream, so it
orders correctly with the surrounding work and can be captured in CUDA graphs.
"""
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import cuda as _cuda
from .cuda_libraries import cuda_include_dirs
from .ops import cuda_runtime

_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\(\s*(\d+)[^)]*\)\s+)?void\s+'
    r'(?:__launch_bounds__\s*\(\s*(\d+)[^)]*\)\s+)?([A-Za-z_]\w*)\s*\(')
_EXTENT = re.compile(r"//\s*\[thread_extent\]\s*(blockIdx|threadIdx)\.([xyz])\s*=\s*(\d+)")
_AXES = {"x": 0, "y": 1, "z": 2}


class LaunchConfig:
    """What a kernel source says about itself: its name, grid and block."""

    def __init__(self, name: str, grid: Tuple[int, int, int], block: Tuple[int, int, int],
                 launch_bounds: Optional[int]):
        self.name, self.grid, self.block, self.launch_bounds = name, grid, block, launch_bounds


def parse_kernel(source: str) -> LaunchConfig:
    """Finds the kernel's name, launch bounds and thread extents in `source`."""
    kernels = _KERNEL.findall(source)
    if len(kernels) != 1:
        raise ValueError('tutel.jit.create_cuda_kernel: the source must define exactly one '
                         f'`extern "C" __global__ void NAME(...)` kernel, found {len(kernels)}')
    bounds_before, bounds_after, name = kernels[0]
    bounds = int(bounds_before or bounds_after) if (bounds_before or bounds_after) else None
    extents = {"blockIdx": [1, 1, 1], "threadIdx": [1, 1, 1]}
    stated = set()
    for kind, axis, value in _EXTENT.findall(source):
        extents[kind][_AXES[axis]] = int(value)
        stated.add((kind, axis))
    if ("threadIdx", "x") not in stated and bounds is not None:
        extents["threadIdx"][0] = bounds
    block = tuple(extents["threadIdx"])
    threads = block[0] * block[1] * block[2]
    if bounds is not None and threads > bounds:
        raise ValueError(f"tutel.jit.create_cuda_kernel: the thread extents {block} ({threads} threads) "
                         f"exceed __launch_bounds__({bounds})")
    if any(value < 1 for value in extents["blockIdx"] + extents["threadIdx"]):
        raise ValueError("tutel.jit.create_cuda_kernel: thread extents must be >= 1")
    return LaunchConfig(name, tuple(extents["blockIdx"]), block, bounds)


class CudaKernel:
    """A compiled user kernel: call it with CUDA tensors, ``extra=[ints]``, ``blocks=[grid]``."""

    def __init__(self, source: str, config: LaunchConfig):
        self.source = source
        self.config = config
        self._functions: Dict[int, int] = {}  # device index -> CUfunction

    def _function(self, device: int) -> int:
        if device not in self._functions:
            options = ["--std=c++17"] + [f"-I{path}" for path in cuda_include_dirs()]
            self._functions[device] = cuda_runtime.user_kernel_function(self.source, self.config.name, options,
                                                                        device)
        return self._functions[device]

    def __call__(self, *inputs: torch.Tensor, extra: Sequence[int] = (), blocks: Sequence[int] = ()) -> None:
        where = f"tutel.jit kernel {self.config.name}"
        for i, tensor in enumerate(inputs):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
                raise TypeError(f"{where}: argument {i} must be a CUDA tensor, got "
                                f"{tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
            if tensor.device != inputs[0].device:
                raise ValueError(f"{where}: all tensors must be on one device; argument {i} is on "
                                 f"{tensor.device}, argument 0 on {inputs[0].device}")
        integers = [_as_int(value, f"{where}: extra[{i}]") for i, value in enumerate(extra)]
        grid = list(self.config.grid)
        if blocks:
            if len(blocks) > 3:
                raise ValueError(f"{where}: blocks has at most 3 dimensions, got {list(blocks)}")
            grid = [_as_int(value, f"{where}: blocks[{i}]") for i, value in enumerate(blocks)]
            grid += [1] * (3 - len(grid))
            if any(value < 1 for value in grid):
                raise ValueError(f"{where}: blocks must be >= 1, got {list(blocks)}")
        device = inputs[0].device.index if inputs else torch.cuda.current_device()
        cuda_runtime.launch_function(self._function(device), device, grid, list(self.config.block),
                                     [tensor.data_ptr() for tensor in inputs], integers)


def _as_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    return value


def create_cuda_kernel(source: str, keyword_dict: Dict[str, object] = {}) -> Callable[..., None]:  # noqa: B006
    """Compiles (on first call, per device) a CUDA kernel from source; see the module docstring.

    Args:
        source: CUDA C++ with one ``extern "C" __global__`` kernel.
        keyword_dict: ``@key@`` placeholders and their replacements.

    Returns:
        ``f(*cuda_tensors, extra=[ints], blocks=[grid dims])``.
    """
    _cuda.require_built("tutel.jit.create_cuda_kernel")
    if not isinstance(source, str):
        raise TypeError(f"tutel.jit.create_cuda_kernel: `source` must be a str, got {type(source).__name__}")
    for key, value in dict(keyword_dict).items():
        source = source.replace(f"@{key}@", str(value))
    return CudaKernel(source, parse_kernel(source))


__all__: List[str] = ["create_cuda_kernel"]
