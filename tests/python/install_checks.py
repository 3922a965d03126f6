"""Tests that need an install step rather than a GPU (NVRTC, the CUDA headers, mpiexec,
scikit-learn): skipped where it is missing on a developer's machine, failed under CI=true,
where tests/setup_env.sh installs every one of them, so a missing step cannot pass unnoticed."""
import os

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(available: bool, what: str, how: str) -> None:
    """Skips the running test when `what` is missing (`how` says how to install it); under
    CI=true fails it instead."""
    if available:
        return
    message = f"{what} is missing ({how}; tests/setup_env.sh installs it)"
    if IN_CI:
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


def module_requires(available: bool, what: str, how: str):
    """An autouse fixture applying `require` to every test of a module:
    ``_needs_x = module_requires(...)`` at module level."""
    @pytest.fixture(autouse=True)
    def _requires():
        require(available, what, how)
    return _requires
