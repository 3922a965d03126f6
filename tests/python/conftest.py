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
