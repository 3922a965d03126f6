"""Helpers for comparing CUDA results with the CPU operators."""
import platform

import torch

# The CPU kernels are compiled without fused multiply-add on x86-64 (it is not
# in the baseline instruction set), and the CUDA kernels with --fmad=false, so
# weighted sums round identically there.  Elsewhere (aarch64 compilers fuse by
# default) they may differ in the last bit.
BITWISE_HOST = platform.machine() in ("x86_64", "AMD64")

# Dot products are reductions in a different order on each device, so their results differ by
# a few roundings of the terms summed, not of the result: a dot that cancels to near zero keeps
# the absolute error of its large terms.  The absolute tolerance is therefore relative to the
# largest result in the tensor (at least 1), which stands for the size of the terms.
DOT_TOLERANCES = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
}

cuda_available = torch.cuda.is_available()


def to_cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


def assert_identical(cpu: torch.Tensor, gpu: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and values (NaN where the other has NaN; +0 == -0)."""
    gpu = gpu.cpu()
    assert cpu.dtype == gpu.dtype, f"{what}: dtype {cpu.dtype} vs {gpu.dtype}"
    assert cpu.shape == gpu.shape, f"{what}: shape {tuple(cpu.shape)} vs {tuple(gpu.shape)}"
    if cpu.is_floating_point():
        nan = cpu.isnan()
        assert torch.equal(nan, gpu.isnan()), f"{what}: NaN positions differ"
        cpu, gpu = cpu.masked_fill(nan, 0), gpu.masked_fill(nan, 0)
    if not torch.equal(cpu, gpu):
        diff = (cpu.double() - gpu.double()).abs()
        raise AssertionError(f"{what}: {int((diff > 0).sum())} of {cpu.numel()} values differ, "
                             f"largest by {float(diff.max())}")


def assert_data_matches(cpu: torch.Tensor, gpu: torch.Tensor, what: str = "") -> None:
    """Bit for bit on hosts without fused multiply-add, else within one rounding."""
    if BITWISE_HOST:
        assert_identical(cpu, gpu, what)
    else:
        tolerance = dict(rtol=1e-15, atol=0) if cpu.dtype == torch.float64 else dict(rtol=1e-6, atol=0)
        if cpu.dtype in (torch.float16, torch.bfloat16):
            tolerance = dict(rtol=1e-2, atol=0)
        torch.testing.assert_close(gpu.cpu(), cpu, msg=lambda detail: f"{what}: {detail}", **tolerance)


def assert_dots_match(cpu: torch.Tensor, gpu: torch.Tensor, what: str = "", terms: float = 0.0) -> None:
    """Equal up to the reordering of sums: DOT_TOLERANCES, the absolute part scaled by the size of
    the terms summed: `terms` where the caller knows it (results that cancel, e.g. through a
    normalisation, are much smaller than their terms), else the largest result."""
    tolerance = dict(DOT_TOLERANCES[cpu.dtype])
    largest = float(cpu.abs().max()) if cpu.numel() else 0.0
    tolerance["atol"] *= max(1.0, largest, terms)
    torch.testing.assert_close(gpu.cpu(), cpu, msg=lambda detail: f"{what}: {detail}", **tolerance)
