"""Shared fixtures: seeded randomness, per-dtype tolerances and hypothesis's profiles, and the checks
that skip a test on a PyTorch without the feature it tests."""
import functools
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


@functools.lru_cache(maxsize=None)
def _why_fullgraph_cannot_set_tensor_attributes():
    """None where torch.compile(fullgraph=True) traces setting an attribute on a tensor made in the
    graph (moe_layer's `y.l_aux = ...`, Tutel's API), else the compiler's first line of why not."""
    def attribute_on_a_new_tensor(x):
        y = x * 2
        y.l_aux = x.sum()
        return y
    try:
        torch.compile(attribute_on_a_new_tensor, fullgraph=True, backend="eager")(torch.ones(2))
    except Exception as error:  # torch._dynamo.exc.Unsupported and what older releases raise instead
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
    return None


def require_fullgraph_tensor_attributes():
    """Skips the running test (a moe_layer compiled with fullgraph=True) on a PyTorch whose
    torch.compile cannot set an attribute on a tensor inside one graph (the oldest supported
    releases: there the layer compiles with a graph break at `y.l_aux`)."""
    reason = _why_fullgraph_cannot_set_tensor_attributes()
    if reason is not None:
        pytest.skip(f"needs torch.compile(fullgraph=True) to set an attribute on a tensor (moe_layer's y.l_aux), "
                    f"which torch {torch.__version__} cannot: {reason}")


def require_grouped_mm():
    """Skips the running test on a PyTorch without torch.nn.functional.grouped_mm (the oldest
    supported releases): what it tests is the path that takes grouped_mm."""
    import torch.nn.functional as F
    if not hasattr(F, "grouped_mm"):
        pytest.skip(f"needs torch.nn.functional.grouped_mm, which torch {torch.__version__} lacks")


@pytest.fixture
def device_grouped_mm_path(monkeypatch):
    """Takes the path devices take in tutel.ops.grouped_mm (torch.nn.functional.grouped_mm, the bias
    added by row index) on the CPU, where grouped_mm has a kernel for float32 / bfloat16 operands,
    and makes grouped_mm behave as on a GPU, where it leaves the result rows past the last group
    unwritten: they come back as NaN, so a result that depends on them shows it."""
    import torch.nn.functional as F
    import tutel.ops.grouped_mm as grouped_mm_module
    require_grouped_mm()
    monkeypatch.setattr(grouped_mm_module, "_GROUPED_MM_ON_CPU", True)
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


@pytest.fixture
def keep_threads():
    """Restores torch's thread count after a test that sets it (the benchmarks' smoke runs)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
