"""Every benchmark script runs once at tiny sizes (--smoke) and writes JSON that parses, and the
report is rebuilt from it, so the suite in benchmarks/ cannot rot.  No timing is checked here."""
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmark_scripts import BENCHMARKS_DIR, load_script


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("benchmark_results"))


EXPECTED_KEYS = {"layer": ["rows", "roofline", "profile"], "scaling": ["rows", "token_sweep", "expert_sweep"],
                 "dispatch": ["dispatch", "routing", "metadata"], "dropless": ["rows"], "grouped_gemm": ["rows"],
                 "quantized_experts": ["rows", "targets"], "quantized_linear": ["rows"]}


@pytest.mark.parametrize("name", ["layer", "scaling", "dispatch", "dropless", "grouped_gemm", "quantized_experts",
                                  "quantized_linear"])
def test_benchmark_smoke_run_writes_json(name, results_dir, keep_threads):
    returned = load_script(name).main(["--smoke", "--threads", "1", "--out", results_dir])
    with open(os.path.join(results_dir, f"{name}.json")) as handle:
        written = json.load(handle)
    assert written["benchmark"] == name and written["smoke"] is True and written["machine"]["torch"]
    for key in EXPECTED_KEYS[name]:
        assert written[key], key
        assert key in returned
    rows = written.get("rows") or written.get("dispatch")
    timed = [value for row in rows for key, value in row.items() if key == "ms" or key.endswith("_ms")]
    assert timed and all(value > 0 for value in timed)


def run_dist_alltoall_smoke(out: str) -> dict:
    """The all-to-all benchmark needs real processes: it runs under torch.distributed.run."""
    repo = os.path.dirname(BENCHMARKS_DIR)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", TUTEL_GLOBAL_TIMEOUT_SEC="60")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(BENCHMARKS_DIR, "dist_alltoall.py"), "--smoke", "--out", out]
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-4000:]
    with open(os.path.join(out, "dist_alltoall.json")) as handle:
        return json.load(handle)


def test_dist_alltoall_smoke_run_on_two_processes(results_dir):
    written = run_dist_alltoall_smoke(results_dir)
    assert written["world_size"] == 2 and written["smoke"] is True
    for row in written["rows"]:
        assert all(row[key] > 0 for key in ("raw_ms", "plain_ms", "net_ms", "overlap4_ms"))


def test_report_rebuilds_the_page_from_smoke_results(results_dir, tmp_path):
    for name in EXPECTED_KEYS:  # the page needs every benchmark's JSON (written by the tests above)
        if not os.path.exists(os.path.join(results_dir, f"{name}.json")):
            load_script(name).main(["--smoke", "--threads", "1", "--out", results_dir])
    if not os.path.exists(os.path.join(results_dir, "dist_alltoall.json")):
        run_dist_alltoall_smoke(results_dir)
    doc, images = tmp_path / "performance.md", tmp_path / "images"
    text = load_script("report").main(["--results", results_dir, "--doc", str(doc), "--images", str(images)])
    assert doc.read_text() == text
    for heading in ("## Machine", "## Bytes and FLOPs per kernel", "## moe_layer against the ideal",
                    "## Scaling", "## Dispatch and routing", "## Dropless without padding",
                    "## Expert-parallel exchange", "## Grouped expert products"):
        assert heading in text
    for sweep in ("tokens", "experts"):
        assert (images / f"performance_scaling_{sweep}.png").stat().st_size > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k", [(2048, 4, 2), (300, 16, 1), (64, 8, 8)])
def test_naive_layer_computes_the_layers_function(dtype, tokens, experts, top_k):
    """The benchmark's naive GShard layer and moe_layer agree within the dtype's bound
    (_models.NAIVE_RELATIVE_BOUND), also where a 16-bit float could not count an expert's
    slots (loads > 256) and where 16-bit probabilities tie."""
    load_script("layer")  # puts benchmarks/ on sys.path
    import _models
    case = _models.LayerCase(tokens, 32, 16, experts, top_k, dtype, seed=3)
    difference = case.naive_difference()  # raises above the bound
    with torch.no_grad():
        scale = float(case.layer(case.inputs["x"]).abs().max())
    assert difference <= _models.NAIVE_RELATIVE_BOUND[dtype] * scale
