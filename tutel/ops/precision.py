"""Which dtype the expert GEMMs of 16-bit data run in on this CPU.

On a CPU without native bfloat16 / float16 dot products (no AVX512-BF16 / AMX / AVX512-FP16,
which oneDNN reports), PyTorch's 16-bit GEMMs convert inside the kernel and run slower than
float32 ones.  Once every expert multiplies enough rows, converting the operands to float32,
multiplying in float32 and rounding the product back is faster; for a few rows per expert
(decoding) the GEMMs read the weights once and converting them would cost more than it saves.
Where that line lies, and the benchmark that measures it: ``UPCAST_MIN_ROWS_PER_EXPERT`` in
tutel/rules/lines.py.  The product differs from the 16-bit GEMM's only by its rounding: both
accumulate in float32.
"""
import torch

from ..rules.lines import UPCAST_MIN_ROWS_PER_EXPERT  # the line and its reason: tutel/rules/lines.py
from .tracing import eager_without_grad


def _probe(name: str) -> bool:
    try:
        return bool(getattr(torch.ops.mkldnn, name)())
    except (AttributeError, RuntimeError):
        return True  # cannot tell: keep PyTorch's own choice


# Read once at import, so that torch.compile traces a constant.
_NATIVE = {torch.bfloat16: _probe("_is_mkldnn_bf16_supported"), torch.float16: _probe("_is_mkldnn_fp16_supported")}


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs `dtype` (bfloat16 / float16) GEMMs natively on this CPU."""
    return _NATIVE.get(dtype, True)


def gemm_dtype(dtype: torch.dtype, device: torch.device, rows_per_expert: float) -> torch.dtype:
    """The dtype to run expert GEMMs of `dtype` operands in, for about `rows_per_expert` rows each."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return dtype
    if rows_per_expert < UPCAST_MIN_ROWS_PER_EXPERT or cpu_has_native(dtype):
        return dtype
    return torch.float32


def widened(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` (the dtype gemm_dtype chose).  Eager CPU tensors without autograd convert into a
    buffer of tutel's block cache (``tutel::to_dtype``): widening 16-bit expert weights makes
    hundreds of MB per call, and a fresh tensor of that size costs more in page faults than the
    conversion itself.  Elsewhere ``t.to(dtype)``."""
    if t.dtype == dtype:
        return t
    if t.device.type == "cpu" and eager_without_grad(t):
        return torch.ops.tutel.to_dtype(t, dtype)
    return t.to(dtype)
