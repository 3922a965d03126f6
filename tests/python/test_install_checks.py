"""A test that needs an install step fails under CI=true when the step is missing, and skips
elsewhere (install_checks.require)."""
import pytest

import install_checks


def test_missing_install_fails_under_ci(monkeypatch):
    monkeypatch.setattr(install_checks, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="CI=true and mpiexec is missing"):
        install_checks.require(False, "mpiexec", "apt-get install openmpi-bin")
    install_checks.require(True, "mpiexec", "apt-get install openmpi-bin")  # present: nothing happens


def test_missing_install_skips_elsewhere(monkeypatch):
    monkeypatch.setattr(install_checks, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match="scikit-learn is missing"):
        install_checks.require(False, "scikit-learn", "pip install '.[examples]'")


def test_ci_is_read_from_the_environment():
    import importlib
    import os
    expected = os.environ.get("CI", "").lower() == "true"
    assert importlib.reload(install_checks).IN_CI is expected
