"""The supported PyTorch range (tutel/torch_versions.py): `import tutel` refuses a release below it
with one clear error, and setup.py, README.md and docs/getting-started.md state the same range.
Also setup.py's choice of the CUDA host code, on fake CUDA toolkits: built only where the headers and
runtime it needs are found, otherwise a CPU-only build with one line saying why, or (with
TUTEL_WITH_CUDA=1) an immediate error naming what is missing and CUDA_HOME."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from tutel import torch_versions
from tutel.torch_versions import NEWEST_TESTED, OLDEST, REQUIREMENT

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _release_before(version):
    """The release just below `version` as the tests state it: one patch (or minor) lower."""
    major, minor, patch = (int(part) for part in version.split("+")[0].split("."))
    return f"{major}.{minor}.{patch - 1}" if patch else f"{major}.{minor - 1}.0"


def _import_tutel_as(version):
    """`import tutel` in a fresh process whose torch reports `version`."""
    code = f"import torch; torch.__version__ = {version!r}; import tutel; print('imported')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)


def test_import_refuses_a_torch_below_the_range():
    version = _release_before(OLDEST) + "+cu121"
    result = _import_tutel_as(version)
    assert result.returncode != 0 and "imported" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tutel.torch_versions.UnsupportedTorchVersion: tutel needs PyTorch >= " + OLDEST), last
    assert f"torch {version} is installed" in last and NEWEST_TESTED in last and REQUIREMENT in last


def test_import_accepts_a_release_newer_than_the_tested_ones():
    result = _import_tutel_as("2.16.0a0+git1234567")
    assert result.returncode == 0 and result.stdout.strip() == "imported", result.stderr[-2000:]


@pytest.mark.parametrize("version", [_release_before(OLDEST), "2.5.1+cu124", "2.3.1", "1.13.1", "not-a-release", ""])
def test_check_supported_refuses_releases_below_the_range(version):
    assert not torch_versions.is_supported(version)
    with pytest.raises(torch_versions.UnsupportedTorchVersion, match=rf"torch {re.escape(version)} is installed"):
        torch_versions.check_supported(version)


@pytest.mark.parametrize("version", [OLDEST, OLDEST + "+cpu", NEWEST_TESTED, "2.10.0", "2.16.0a0+git1234567", "3.0"])
def test_check_supported_accepts_the_range_and_newer_releases(version):
    assert torch_versions.is_supported(version) and torch_versions.check_supported(version) == version


def test_release_numbers_compare_as_numbers():
    # "2.10.0" < "2.6.0" as strings; as releases it is newer.  Labels after the number do not count.
    assert torch_versions.release("2.10.0") == (2, 10, 0) > torch_versions.release("2.6.0")
    assert torch_versions.release("2.6.0+cu124") == torch_versions.release("2.6") == (2, 6, 0)
    assert torch_versions.release("2.16.0a0+git1234567") == (2, 16, 0)
    assert torch_versions.release("not-a-release") is None and torch_versions.release("") is None
    assert torch_versions.is_supported(torch.__version__)
    assert issubclass(torch_versions.UnsupportedTorchVersion, ImportError)


def _read(path):
    with open(os.path.join(REPO, path)) as handle:
        return " ".join(handle.read().split())


def test_readme_and_getting_started_state_the_range():
    stated = f"PyTorch {OLDEST} to {NEWEST_TESTED}"
    for page in ("README.md", "docs/getting-started.md"):
        text = _read(page)
        assert stated in text, f"{page} does not say '{stated}'"
        # no other range left behind: every "PyTorch X to Y" / ">= X" names these ends
        for low, high in re.findall(r"PyTorch (\d+\.\d+(?:\.\d+)?) to (\d+\.\d+(?:\.\d+)?)", text):
            assert (low, high) == (OLDEST, NEWEST_TESTED), f"{page} states PyTorch {low} to {high}"
        assert not re.search(r"\(>= ?2\.\d", text), f"{page} states another floor"
    # what the test command installs: both ends, each at the version this module names
    tests = _read("README.md").split("The test command installs", 1)[1].split("Every duration", 1)[0]
    assert f"`torch=={NEWEST_TESTED}`" in tests and f"`torch=={OLDEST}`" in tests


def test_the_test_scripts_install_both_ends():
    setup_env, oldest = _read("tests/setup_env.sh"), _read("tests/integration/torch_oldest/run.sh")
    assert 'runpy.run_path("tutel/torch_versions.py")["NEWEST_TESTED"]' in setup_env
    assert 'install_pinned "$TEST_TORCH"' in setup_env
    assert 'runpy.run_path("tutel/torch_versions.py")["OLDEST"]' in oldest and '"torch==${VERSION}"' in oldest
    assert "bash tests/integration/torch_oldest/run.sh" in _read("tests/run_all.sh")


def _setup_module():
    """setup.py imported as a module (its setup() call runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("tutel_setup_script", os.path.join(REPO, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_declares_the_range():
    setup = _setup_module()
    assert setup.torch_versions()["REQUIREMENT"] == REQUIREMENT == f"torch>={OLDEST}"
    text = _read("setup.py")
    assert 'install_requires=[torch_versions()["REQUIREMENT"]]' in text and "torch>=2" not in text


def _toolkit(root, headers=True, runtime=True):
    """A fake CUDA toolkit at `root`: an nvcc stub, and the runtime header / library when asked."""
    os.makedirs(os.path.join(root, "bin"), exist_ok=True)
    with open(os.path.join(root, "bin", "nvcc"), "w") as handle:
        handle.write("#!/bin/sh\nexit 1\n")
    if headers:
        os.makedirs(os.path.join(root, "include"), exist_ok=True)
        open(os.path.join(root, "include", "cuda_runtime_api.h"), "w").close()
    if runtime:
        os.makedirs(os.path.join(root, "lib64"), exist_ok=True)
        open(os.path.join(root, "lib64", "libcudart.so"), "w").close()
    return str(root)


@pytest.mark.parametrize("headers, runtime", [(True, True), (False, True), (True, False), (False, False)])
def test_cuda_host_code_only_with_its_headers_and_runtime(tmp_path, headers, runtime):
    setup = _setup_module()
    home = _toolkit(tmp_path / "cuda", headers, runtime)
    chosen, why_not = setup.cuda_build_choice(None, None, "2.15.0+cu132", "13.2", home)
    assert chosen == (headers and runtime)
    if chosen:
        assert why_not is None
    else:
        assert why_not.startswith("tutel: building the CPU operators only: PyTorch 2.15.0+cu132 is a CUDA build")
        assert f"CUDA_HOME={home}" in why_not and "TUTEL_WITH_CUDA=1" in why_not
        assert ("cuda_runtime_api.h" in why_not) == (not headers) and ("libcudart" in why_not) == (not runtime)
        with pytest.raises(SystemExit, match=r"TUTEL_WITH_CUDA=1, but the CUDA toolkit at CUDA_HOME=.*lacks .*"
                                             r"Set CUDA_HOME to a CUDA toolkit \(CUDA 13\.2"):
            setup.cuda_build_choice("1", None, "2.15.0+cu132", "13.2", home)


def test_cuda_build_choice_settings(tmp_path):
    setup = _setup_module()
    full = _toolkit(tmp_path / "cuda")
    assert setup.cuda_build_choice("1", None, "2.15.0", "13.2", full) == (True, None)
    for off in ("0", "off", "false"):  # leaves them out even where they could be built
        assert setup.cuda_build_choice(off, None, "2.15.0", "13.2", full) == (False, None)
    assert setup.cuda_build_choice(None, "1", "2.15.0", "13.2", full) == (False, None)  # Tutel's NO_CUDA=1
    # A CPU build of PyTorch: CPU-only, silently; insisting names the reason.
    assert setup.cuda_build_choice(None, None, "2.13.0+cpu", None, full) == (False, None)
    with pytest.raises(SystemExit, match=r"not a CUDA build \(torch\.version\.cuda is None\)"):
        setup.cuda_build_choice("1", None, "2.13.0+cpu", None, full)
    # No toolkit found at all (PyTorch's CUDA_HOME is None).
    chosen, why_not = setup.cuda_build_choice(None, None, "2.15.0", "13.2", None)
    assert not chosen and "no CUDA toolkit was found" in why_not
    with pytest.raises(SystemExit, match="no CUDA toolkit was found"):
        setup.cuda_build_choice("yes", None, "2.15.0", "13.2", None)


@pytest.mark.parametrize("with_cuda", ["", "1"])
def test_setup_on_this_torch_with_a_toolkit_without_headers(tmp_path, with_cuda):
    """setup.py run for real against the installed PyTorch, CUDA_HOME pointing at a toolkit with only
    an nvcc (as a bare nvcc on PATH makes PyTorch guess /usr/local).  A CUDA build of PyTorch builds
    CPU-only, saying why, or with TUTEL_WITH_CUDA=1 stops at once; a CPU build says nothing or,
    insisted on, that PyTorch has no CUDA.  (--version: the choice is made, nothing compiled.)"""
    env = dict(os.environ, CUDA_HOME=_toolkit(tmp_path / "cuda", headers=False, runtime=False),
               TUTEL_WITH_CUDA=with_cuda)
    result = subprocess.run([sys.executable, "setup.py", "--version"], capture_output=True, text=True, cwd=REPO,
                            env=env, timeout=300)
    if torch.version.cuda is None:
        if with_cuda:
            assert result.returncode != 0 and "is not a CUDA build" in result.stderr
        else:
            assert result.returncode == 0 and "CPU operators only" not in result.stderr
    elif with_cuda:
        assert result.returncode != 0 and "TUTEL_WITH_CUDA=1, but the CUDA toolkit at CUDA_HOME=" in result.stderr
        assert "cuda_runtime_api.h" in result.stderr
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        (line,) = [line for line in result.stderr.splitlines() if "CPU operators only" in line]
        assert f"CUDA_HOME={env['CUDA_HOME']} lacks" in line and "cuda_runtime_api.h" in line
    if result.returncode == 0:
        assert result.stdout.strip().splitlines()[-1] == _setup_module().version()
