"""Importing tutel without its compiled extension fails with build instructions."""
import os
import shutil
import subprocess
import sys

import tutel


def test_missing_extension_message(tmp_path):
    package = os.path.dirname(tutel.__file__)
    copy = tmp_path / "tutel"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__"))
    result = subprocess.run([sys.executable, "-c", "import tutel"], cwd=tmp_path, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0
    assert "ImportError: tutel's compiled extension (tutel._C) is not built" in result.stderr
    assert "pip install --no-build-isolation ." in result.stderr


def test_extension_registers_the_operators():
    for name in ("route_topk", "assign_locations", "cumsum_sub_one", "gather_slots", "scatter_slots"):
        assert hasattr(torch_ops(), name)


def torch_ops():
    import torch
    return torch.ops.tutel
