"""benchmarks/transformers_moe.py runs at tiny sizes (--smoke) and writes JSON that parses, with every
candidate timed on every case.  No timing is checked here."""
import importlib.util
import json
import os
import sys

BENCHMARKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "benchmarks")


def load_benchmark():
    if BENCHMARKS_DIR not in sys.path:
        sys.path.insert(0, BENCHMARKS_DIR)
    path = os.path.join(BENCHMARKS_DIR, "transformers_moe.py")
    spec = importlib.util.spec_from_file_location("tutel_benchmark_transformers_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_json(tmp_path):
    import torch
    threads = torch.get_num_threads()
    try:
        returned = load_benchmark().main(["--smoke", "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    with open(tmp_path / "transformers_moe.json") as handle:
        written = json.load(handle)
    assert written["benchmark"] == "transformers_moe" and written["smoke"] is True
    assert written["limits"]["read_gbps"] > 0 and written["limits"]["gemm_gflops_float32"] > 0
    rows = written["rows"]
    assert {row["family"] for row in rows} == {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"}
    assert {row["dtype"] for row in rows} == {"float32", "bfloat16"}
    assert {row["pass"] for row in rows} == {"fwd", "fwd+bwd"}
    for row in rows:
        for name in ("eager", "grouped_mm", "tutel"):
            assert row[f"{name}_ms"] > 0, (row["family"], name)
        assert row["limit_ms"] > 0 and row["tutel/limit"] > 0
        # moe_layer holds the weights of the plain SwiGLU families only (gpt-oss clamps its gate).
        assert ("moe_layer_ms" in row) == (row["family"] != "gpt_oss")
    assert returned["rows"] == rows
