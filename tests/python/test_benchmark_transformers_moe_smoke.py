"""benchmarks/transformers_moe.py runs at tiny sizes (--smoke) and writes JSON that parses, with every
candidate timed on every case.  No timing is checked here."""
import json
import sys

from benchmark_scripts import BENCHMARKS_DIR, load_script


def load_benchmark():
    return load_script("transformers_moe")


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
        # tutel's output against the eager backend's, both in the case's dtype
        assert row["tutel_vs_eager"] < (1e-5 if row["dtype"] == "float32" else 3e-2), row
    assert returned["rows"] == rows


def test_gpu_result_gets_its_own_report_section(tmp_path):
    """A run saved as 'transformers_moe_cuda' (what --device cuda writes) appears under "On a GPU"
    with the device name and without the --out directory in its command (here a CPU run stands in)."""
    import importlib
    import torch
    threads = torch.get_num_threads()
    benchmark = load_benchmark()
    try:
        benchmark.main(["--smoke", "--threads", "1", "--out", str(tmp_path), "--families", "qwen3_moe",
                        "--dtypes", "bfloat16", "--result-name", "transformers_moe_cuda"])
        importlib.import_module("dropless").main(["--smoke", "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    report = importlib.import_module("report")
    text = report.main(["--results", str(tmp_path), "--doc", str(tmp_path / "performance.md"),
                        "--images", str(tmp_path / "images")])
    section = text[text.index("## On a GPU"):]
    assert "| qwen3_moe | bfloat16 |" in section and "tutel_vs_eager" in section
    assert "--out" not in section[section.index("Command:"):]


def test_profile_script_prints_a_table_per_backend_and_case(capsys):
    sys.path.insert(0, BENCHMARKS_DIR)
    import importlib
    import torch
    threads = torch.get_num_threads()
    try:
        importlib.import_module("profile_experts").main(["--smoke", "--family", "mixtral", "--tokens", "3",
                                                         "--train-tokens", "4", "--rows", "3"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for case in ("fwd T=3", "fwd+bwd T=4"):
        for backend in ("tutel", "grouped_mm"):
            assert f"mixtral bfloat16 {case} backend={backend}:" in out
    assert "Self CPU time total" in out


def test_separate_16bit_run_has_its_own_json_and_report_section(tmp_path):
    """--result-name writes the run under its own name; benchmarks/report.py shows the main run
    and the separate 16-bit one ('transformers_moe_16bit_large') as two tables."""
    import torch
    import importlib
    threads = torch.get_num_threads()
    benchmark = load_benchmark()
    try:
        benchmark.main(["--smoke", "--threads", "1", "--out", str(tmp_path), "--families", "mixtral"])
        benchmark.main(["--smoke", "--threads", "1", "--out", str(tmp_path), "--families", "deepseek_v3",
                        "--dtypes", "bfloat16", "--result-name", "transformers_moe_16bit_large"])
        importlib.import_module("dropless").main(["--smoke", "--threads", "1", "--out", str(tmp_path)])  # the report's core
    finally:
        torch.set_num_threads(threads)
    with open(tmp_path / "transformers_moe_16bit_large.json") as handle:
        large = json.load(handle)
    assert {(row["family"], row["dtype"]) for row in large["rows"]} == {("deepseek_v3", "bfloat16")}
    assert "--result-name transformers_moe_16bit_large" in large["command"]
    report = importlib.import_module("report")
    doc = tmp_path / "performance.md"
    text = report.main(["--results", str(tmp_path), "--doc", str(doc), "--images", str(tmp_path / "images")])
    main_section = text.index("## Against transformers' experts backends")
    large_section = text.index("### 16-bit cases at large T (a separate run)")
    assert main_section < large_section
    assert "| deepseek_v3 | bfloat16 |" in text[large_section:] and "| mixtral |" in text[main_section:large_section]
    # the targets count the separate run's cases too
    assert "bfloat16: best transformers backend / tutel, every case" in text
