"""Shared fixtures: seeded randomness, per-dtype tolerances and hypothesis's profiles."""
import os
import sys

import hypothesis
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# rtol/atol per dtype when comparing against a float64 reference computed from
# the same (rounded) inputs.
TOLERANCES = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}

ALL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# Property tests: under CI=true hypothesis draws the same examples on every run (derandomize),
# so a CI verdict is reproducible; elsewhere it explores new ones and replays failures it found.
hypothesis.settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


def tolerance(dtype):
    return TOLERANCES[dtype]


@pytest.fixture
def device_grouped_mm_path(monkeypatch):
    """Takes the path devices take in tutel.ops.grouped_mm (torch.nn.functional.grouped_mm, the bias
    added by row index) on the CPU, where grouped_mm has a kernel for float32 / bfloat16 operands,
    and makes grouped_mm behave as on a GPU, where it leaves the result rows past the last group
    unwritten: they come back as NaN, so a result that depends on them shows it."""
    import torch.nn.functional as F
    import tutel.ops.grouped_mm as grouped_mm_module
    monkeypatch.setattr(grouped_mm_module, "_use_grouped_mm",
                        lambda a, b: a.shape[0] > 0 and grouped_mm_module.grouped_mm_supports(a, b))
    real = F.grouped_mm

    def unwritten_tail(a, b, *args, offs=None, **kwargs):
        out = real(a, b, *args, offs=offs, **kwargs)
        if offs is not None and a.dim() == 2 and b.dim() == 3:
            out[int(offs[-1]):] = float("nan")
        return out
    monkeypatch.setattr(F, "grouped_mm", unwritten_tail)


@pytest.fixture
def no_native_16bit(monkeypatch):
    """Makes tutel.ops.precision treat this CPU as one without 16-bit dot products, so 16-bit
    expert GEMMs with enough rows per expert run in float32 (the widened path) on any CPU."""
    import tutel.ops.precision as precision
    monkeypatch.setitem(precision._NATIVE, torch.bfloat16, False)
    monkeypatch.setitem(precision._NATIVE, torch.float16, False)
