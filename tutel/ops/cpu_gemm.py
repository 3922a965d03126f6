"""Which GEMM tutel's CPU expert products run on.

``"tutel"`` (the default): tutel's CPU GEMM (``csrc/gemm``): skinny products that read each
expert's matrix once for groups of a few rows, AMX tile products for bfloat16 groups past them
where the CPU has AMX, and PyTorch's GEMM as single-threaded pieces claimed by the threads for the
rest.  ``"torch"``: PyTorch's GEMM for every group, one ``at::mm`` / ``at::addmm`` after another,
each spread over the threads by PyTorch (as ``torch.nn.functional.grouped_mm`` runs on the CPU).

Every CPU expert product goes through ``torch.ops.tutel.grouped_linear`` and its backward
(``routed_experts``, ``routed_gated_experts``, the layer's experts, ``token_linear``), which read
the choice on each call.  ``TUTEL_CPU_GEMM`` sets it for the process (read at the first product);
the functions here change it while the process runs.  CUDA tensors are not affected.
"""
import contextlib
from typing import Iterator

from .extension import load_extension

#: The values ``TUTEL_CPU_GEMM`` and :func:`set_cpu_gemm` take.
CPU_GEMMS = ("tutel", "torch")


def cpu_gemm() -> str:
    """The GEMM the CPU expert products run on now: ``"tutel"`` or ``"torch"``.

    Raises ValueError when ``TUTEL_CPU_GEMM`` holds another value and nothing was set since."""
    return load_extension()._cpu_gemm()


def set_cpu_gemm(name: str) -> None:
    """Makes the CPU expert products run on `name` (``"tutel"`` or ``"torch"``) from now on, in
    every thread of the process."""
    if not isinstance(name, str):
        raise TypeError(f"set_cpu_gemm: `name` must be one of {CPU_GEMMS}, got {name!r}")
    load_extension()._set_cpu_gemm(name)


@contextlib.contextmanager
def using_cpu_gemm(name: str) -> Iterator[None]:
    """Runs the block's CPU expert products on `name` (``"tutel"`` or ``"torch"``), then restores
    the choice in force before."""
    before = cpu_gemm()
    set_cpu_gemm(name)
    try:
        yield
    finally:
        set_cpu_gemm(before)
