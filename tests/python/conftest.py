"""Shared fixtures: seeded randomness and per-dtype tolerances."""
import os
import sys

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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


def tolerance(dtype):
    return TOLERANCES[dtype]
