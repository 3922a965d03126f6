"""Where to look for the CUDA libraries tutel opens at run time (NVRTC).

The CUDA kernels are compiled by NVRTC on first use, so NVRTC must be found
when the first CUDA operator runs, not when tutel is built.  This module lists
the directories to search, most specific first; the extension tries them in
order and then the system's default library search path.  Standard library
only, so it also runs as a script (``python tutel/cuda_libraries.py`` prints
the directories, one per line).
"""
import importlib.util
import os
from typing import List, Optional

# Sub-directories of the `nvidia` namespace package that hold NVRTC in the pip
# wheels, per CUDA major version: nvidia-cuda-nvrtc 13.x (cu13/lib) and
# nvidia-cuda-nvrtc-cu12 (cuda_nvrtc/lib).
_WHEEL_LIBRARY_DIRS = {13: ("cu13/lib",), 12: ("cuda_nvrtc/lib", "cu12/lib")}
_WHEEL_INCLUDE_DIRS = ("cu13/include", "cuda_nvrtc/include", "cuda_runtime/include", "cu12/include")


def _nvidia_package_dirs() -> List[str]:
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return list(spec.submodule_search_locations)


def _toolkit_roots() -> List[str]:
    """CUDA toolkit roots named by the environment, then the usual default."""
    roots = [os.environ.get(name) for name in ("CUDA_HOME", "CUDA_PATH")]
    roots.append("/usr/local/cuda")
    unique = []
    for root in roots:
        if root and root not in unique:
            unique.append(root)
    return unique


def nvrtc_search_dirs(cuda_major: Optional[int] = None) -> List[str]:
    """Existing directories that may hold libnvrtc, in the order to try them:
    the pip wheels next to this Python (those of CUDA `cuda_major` first: the
    version PyTorch was built for, which the driver is sure to support), then
    $CUDA_HOME, $CUDA_PATH and /usr/local/cuda."""
    majors = sorted(_WHEEL_LIBRARY_DIRS, key=lambda major: (major != cuda_major, -major))
    subdirs = [sub for major in majors for sub in _WHEEL_LIBRARY_DIRS[major]]
    candidates = [os.path.join(base, sub) for base in _nvidia_package_dirs() for sub in subdirs]
    for root in _toolkit_roots():
        candidates += [os.path.join(root, "lib64"), os.path.join(root, "lib")]
    return [path for path in candidates if os.path.isdir(path)]


def cuda_include_dirs() -> List[str]:
    """Existing directories with CUDA headers, for user kernels that include them
    (tutel's own kernels include none)."""
    candidates = [os.path.join(base, sub) for base in _nvidia_package_dirs() for sub in _WHEEL_INCLUDE_DIRS]
    candidates += [os.path.join(root, "include") for root in _toolkit_roots()]
    return [path for path in candidates if os.path.isfile(os.path.join(path, "cuda_runtime.h"))
            or os.path.isfile(os.path.join(path, "nvrtc.h"))]


if __name__ == "__main__":
    print("\n".join(nvrtc_search_dirs()))
