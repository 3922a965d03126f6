"""Helpers for comparing CUDA results with the CPU operators."""
import platform

import torch

# The CPU kernels are compiled without fused multiply-add on x86-64 (it is not
# in the baseline instruction set), and the CUDA kernels with --fmad=false, so
# weighted sums round identically there.  Elsewhere (aarch64 compilers fuse by
# default) they may differ in the last bit.
BITWISE_HOST = platform.machine() in ("x86_64", "AMD64")

# Dot products are reductions in a different order on each device.
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
        torch.testing.assert_close(gpu.cpu(), cpu, msg=what, **tolerance)


def assert_dots_match(cpu: torch.Tensor, gpu: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(gpu.cpu(), cpu, msg=what, **DOT_TOLERANCES[cpu.dtype])
