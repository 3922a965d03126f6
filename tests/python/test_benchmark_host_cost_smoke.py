"""benchmarks/host_cost.py runs (--quick, without Tutel 0.3.3 beside) and writes JSON that parses,
with every case counted on every device it names; its targets are judged, benchmarks/report.py renders
its table, and a reference that is missing or does not load is a column, not a crash.
No timing is checked here."""
import json
import os
import sys

import pytest

from benchmark_scripts import BENCHMARKS_DIR
from host_calls import load_host_cost_benchmark as load_benchmark


def test_quick_run_counts_every_case_and_writes_json(tmp_path, keep_threads):
    pytest.importorskip("transformers")
    returned = load_benchmark().main(["--quick", "--out", str(tmp_path)])
    with open(tmp_path / "host_cost.json") as handle:
        written = json.load(handle)
    assert written["benchmark"] == "host_cost" and written["smoke"] is True
    assert written["rows"] == json.loads(json.dumps(returned["rows"]))
    rows = {(row["case"], row["device"], row["T"], row["candidate"]): row for row in written["rows"]}
    for case in ("experts (Qwen3-MoE)", "moe_layer ffn top-2", "moe_layer llama_ffn top-8"):
        for device in ("cpu", "fake cuda"):
            for tokens in (1, 4):
                ours = rows[(case, device, tokens, "tutel")]
                assert ours["package calls"] > 0 and ours["steady"] == "yes", ours
                assert sum(calls for calls, _ in ours["breakdown"]) == ours["package calls"]
                assert ("us/call" in ours) == (device == "cpu") and ("shape fns" in ours) == (device != "cpu")
                assert "<=" in ours["target"] and ours["met"].split("; ")[-1] in ("yes", "no")
                if case.startswith("moe_layer"):
                    assert ours["path"] and not ours["path"].startswith("?"), ours["path"]
                    assert rows[(case, device, tokens, "Tutel 0.3.3")]["note"] == "not available (no --tutel-reference)"
    for backend in ("eager", "batched_mm", "grouped_mm"):
        row = rows[("experts (Qwen3-MoE)", "cpu", 1, backend)]
        assert row["package calls"] == 0 and row["python calls"] > 0 and row["us/call"] > 0  # none of tutel's
    tiny = rows[("tiny eval moe_layer ffn", "cpu", 1, "tutel")]
    assert tiny["us/call"] > 0 and tiny["met"].startswith("n/a; ")  # no reference: no time verdict


def _row(case: str, device: str, candidate: str, **fields) -> dict:
    return dict(case=case, device=device, T=1, candidate=candidate, **fields)


def test_targets_are_judged_against_the_right_rows():
    bench = load_benchmark()
    rows = [_row("experts (Qwen3-MoE)", "fake cuda", "tutel", **{"package calls": 31}),
            _row("experts (Qwen3-MoE)", "cpu", "tutel", **{"package calls": 5, "us/call": 10.0}),
            _row("experts (Qwen3-MoE)", "cpu", "batched_mm", **{"package calls": 0, "us/call": 12.0}),
            _row("moe_layer ffn top-2", "cpu", "tutel", **{"package calls": 60}),
            _row("tiny eval moe_layer ffn", "cpu", "tutel", **{"package calls": 61, "us/call": 7.0}),
            _row("tiny eval moe_layer ffn", "cpu", "Tutel 0.3.3", **{"package calls": 40, "us/call": 10.0})]
    bench.judge(rows)
    assert [row.get("met") for row in rows] == ["no", "yes", None, "yes", "no (0.70x); no", None]
    assert rows[1]["target"] == "us <= batched_mm's (12.0)"


def test_report_renders_the_host_cost_section():
    """benchmarks/report.py (which writes docs/performance.md) renders host_cost.json's table."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("report", os.path.join(BENCHMARKS_DIR, "report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    result = {"rows": [_row("experts", "cpu", "tutel", **{"package calls": 27, "us/call": 12.5})],
              "columns": ["case", "device", "candidate", "package calls", "us/call"], "threads": 1, "reps": 3,
              "torch": "2.15.0", "reference": "not available", "finished": "2026-12-06 17:00:00",
              "command": "python benchmarks/host_cost.py"}
    text = report.host_cost_section(result)
    assert text.startswith("## Host cost per call")
    assert "| experts | cpu | tutel | 27 | 12.5 |" in text and "python benchmarks/host_cost.py" in text


def test_a_missing_or_broken_reference_is_reported_not_raised(tmp_path):
    bench = load_benchmark()
    assert bench.load_reference(None).reason == "not available (no --tutel-reference)"
    assert "holds no Tutel package" in bench.load_reference(str(tmp_path)).reason
    package = tmp_path / "tutel"
    (package / "impls").mkdir(parents=True)
    (package / "impls" / "moe_layer.py").write_text("")
    (package / "__init__.py").write_text("raise ImportError('no tutel_custom_kernel here')\n")
    broken = bench.load_reference(str(tmp_path))
    assert broken.moe is None and "no tutel_custom_kernel here" in broken.reason
    assert "tutel_reference" not in sys.modules
