"""python -m tutel.check: runs on any machine, prints the environment and the
comparisons, and its exit status says whether everything agreed."""
import os
import subprocess
import sys

import torch

from tutel import check
from tutel.ops import composite

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_module_runs_and_passes_here():
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-m", "tutel.check", "--quick", "--reps", "2", "--no-tests"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for expected in ("== environment", f"pytorch                    {torch.__version__}", "tutel built with CUDA",
                     "TUTEL_CUDA_BACKEND", "== NVRTC", "search directories", "== GPUs",
                     "== composite operators against the CPU operators (cpu, ",
                     "== timing on ", "== result", "every check that can run here agreed"):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    for name in ("route_topk", "assign_locations", "cumsum_sub_one", "gather_slots", "scatter_slots"):
        assert any(line.split()[:2] == [name, "ok"] for line in out.splitlines()), name
    if not torch.cuda.is_available():
        assert "needs a CUDA device" in out


def test_a_mismatch_gives_exit_status_one(monkeypatch, capsys):
    def wrong_cumsum(mask):
        return composite.cumsum.cumsum_sub_one(mask) + 1

    monkeypatch.setattr(composite, "cumsum_sub_one", wrong_cumsum)
    assert check.main(["--quick", "--no-timing", "--no-tests"]) == 1
    out = capsys.readouterr().out
    assert "cumsum_sub_one             MISMATCH: " in out
    assert "FAILED" in out and "Please send this whole output" in out


def test_the_per_gpu_checks_run_with_the_cpu_standing_in(monkeypatch, capsys):
    """check_gpu's code path on a machine without a GPU: the CPU operators stand in for the
    kernels and a fresh chooser for the CUDA one (told the kernels cannot load)."""
    from tutel.ops import backend
    from tutel.ops.self_check import QUICK_SIZES

    monkeypatch.delenv(backend.BACKEND_VARIABLE, raising=False)
    chooser = backend.DeviceBackends(torch.ops.tutel, kernels_unavailable=lambda: "no GPU in this test")
    monkeypatch.setattr(check, "CUDA_BACKENDS", chooser)
    report = check.Report()
    check.check_gpu(report, torch.device("cpu"), QUICK_SIZES[:1])
    out = capsys.readouterr().out
    assert report.failures == []
    for title in ("self-check on cpu", "CUDA kernels against the CPU operators (cpu, ",
                  "composite operators against the CPU operators (cpu, ", "backend in use on cpu"):
        assert f"== {title}" in out, out
    assert "cannot be used on cpu (no GPU in this test)" in out
    assert "route_topk                 composite (no GPU in this test)" in out
