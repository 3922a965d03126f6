"""benchmarks/decode_line.py: the line it reads off its rows, the switch between its two candidates
(traced on fake CUDA tensors, the path a GPU takes), and a run at tiny sizes.  No timing is checked."""
import importlib
import json

import pytest
import torch

from benchmark_scripts import load_script
from launch_count import OperatorCount, fake_cuda
from tutel.experts.routed import routed_experts

DECODE = "tutel.decode_experts.default"


def load_benchmark():
    return load_script("decode_line")


def _rows(times):
    """Rows of one family as decode_line.py writes them: (T, decode ms, grouped ms); k = 2 of E = 8."""
    return [dict(T=t, rows_per_expert=t * 2 / 8, decode_ms=d, grouped_ms=g) for t, d, g in times]


@pytest.mark.parametrize("times, line", [
    ([(1, 0.1, 0.3), (2, 0.1, 0.2), (4, 0.2, 0.2), (8, 0.5, 0.3), (16, 0.4, 0.6)], (4, 1.0)),  # the first loss ends it
    ([(4, 0.2, 0.2), (1, 0.1, 0.3), (2, 0.1, 0.2)], (4, 1.0)),  # unsorted rows; a tie keeps the decode kernel
    ([(1, 0.3, 0.1), (2, 0.1, 0.2)], (0, 0.0)),  # grouped already wins at the smallest T
    ([(1, 0.1, 0.3), (32, 0.2, 0.3)], (32, 8.0)),  # decode wins everywhere measured
    ([(1, 0.1, None), (2, 0.1, 0.2)], (None, None)),  # a capture that failed: no line
])
def test_the_line_is_the_last_token_count_of_the_first_unbroken_run_of_decode_wins(times, line):
    found = load_benchmark().decode_lines(_rows(times), "decode_ms", "grouped_ms")
    assert (found["T"], found["rows_per_expert"]) == line


def test_the_summary_reads_a_line_per_family_and_dtype_for_eager_and_graph_times():
    module = load_benchmark()
    rows = [dict(family=f, dtype="bfloat16", k=2, E=8, T=t, rows_per_expert=t / 4, decode_ms=d, grouped_ms=g,
                 decode_graph_ms=dg, grouped_graph_ms=gg)
            for f, t, d, g, dg, gg in [("a", 1, 1, 2, 1, 2), ("a", 8, 3, 2, 1, 2), ("b", 1, 2, 1, 1, 2)]]
    summary = {row["family"]: row for row in module.line_summary(rows)}
    assert (summary["a"]["eager_line_T"], summary["a"]["graph_line_T"]) == (1, 8)
    assert (summary["b"]["eager_line_T"], summary["b"]["graph_line_T"]) == (0, 1)
    assert summary["a"]["graph_line_rows_per_expert"] == 2.0
    assert summary["a"]["measured_T"] == 8 and summary["b"]["measured_T"] == 1


def _summary(family, dtype, eager, graph, measured_T=32):
    """A line_summary row: (T, rows per expert) of the eager and graph lines."""
    return dict(family=family, dtype=dtype, k=2, E=8, measured_T=measured_T, eager_line_T=eager[0],
                eager_line_rows_per_expert=eager[1], graph_line_T=graph[0], graph_line_rows_per_expert=graph[1])


def _payload(lines, **changes):
    payload = dict(lines=lines, capability="9.0", device_name="NVIDIA H200", smoke=False,
                   finished="2026-11-28 12:00:00", command="python benchmarks/decode_line.py")
    payload.update(changes)
    return payload


def test_a_dtypes_line_is_the_least_over_the_families_where_grouped_won():
    module = load_benchmark()
    lines = module.measured_lines(_payload([
        _summary("a", "bfloat16", (16, 4.0), (12, 3.0)),   # the smaller of its eager and graph lines
        _summary("b", "bfloat16", (8, 2.0), (24, 6.0)),
        _summary("c", "bfloat16", (32, 8.0), (32, 8.0)),   # nowhere slower up to the largest T: no bound
        _summary("a", "float16", (32, 1.0), (32, 1.0)),
        _summary("b", "float16", (4, 0.25), (4, 0.25), measured_T=4),  # won at its every T too
        _summary("a", "float32", (0, 0.0), (2, 0.5)),      # grouped won at once
    ]), "decode_line_cuda.json")
    assert [(line.dtype, line.max_rows_per_expert) for line in lines] == [
        ("bfloat16", 2.0), ("float16", None), ("float32", 0.0)]
    assert all(line.capability == "9.0" and line.device_name == "NVIDIA H200" for line in lines)
    assert lines[0].source == "decode_line_cuda.json, finished 2026-11-28 12:00:00: python benchmarks/decode_line.py"


@pytest.mark.parametrize("changes, message", [
    (dict(smoke=True), "not --smoke"),
    (dict(capability=None), "CUDA device"),
    (dict(lines=[_summary("a", "bfloat16", (4, 1.0), (None, None))]), r"a \(bfloat16\) has no line"),
])
def test_a_run_that_cannot_set_a_line_is_refused(changes, message):
    payload = _payload(**{"lines": [_summary("a", "bfloat16", (4, 1.0), (4, 1.0))], **changes})
    with pytest.raises(ValueError, match=message):
        load_benchmark().measured_lines(payload, "decode_line_cuda.json")


def test_apply_sets_the_runs_lines_in_the_lines_file(tmp_path):
    from tutel.ops.decode_lines import DecodeLine, read_lines, write_lines
    module = load_benchmark()
    lines_path, results_path = str(tmp_path / "lines.json"), tmp_path / "decode_line_cuda.json"
    kept = DecodeLine("8.0", "bfloat16", 1.5, "NVIDIA A100", "benchmarks/results/an earlier run")
    write_lines([kept, kept._replace(capability="9.0", max_rows_per_expert=9.0)], lines_path)
    results_path.write_text(json.dumps(_payload([_summary("a", "bfloat16", (8, 2.0), (8, 2.0)),
                                                 _summary("a", "float16", (32, 8.0), (32, 8.0))])))
    returned = module.main(["--apply", str(results_path), "--lines", lines_path])
    table = read_lines(lines_path)
    assert {key: line.max_rows_per_expert for key, line in table.items()} == {
        ("8.0", "bfloat16"): 1.5, ("9.0", "bfloat16"): 2.0, ("9.0", "float16"): None}
    assert table[("8.0", "bfloat16")] == kept and table[("9.0", "bfloat16")].device_name == "NVIDIA H200"
    assert [line["dtype"] for line in returned["applied"]] == ["bfloat16", "float16"]


def _routed_call(tokens):
    """routed_experts inference on fake CUDA tensors (SwiGLU, 8 experts of top-2)."""
    hidden, inter, experts = 64, 32, 8
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, experts, (tokens, 2), device="cuda")
    weights = torch.rand(tokens, 2, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)

    def call():
        with torch.no_grad():
            return routed_experts(x, ids, weights, up, down, gate="swiglu")
    return call


def test_the_grouped_candidate_runs_the_grouped_path_and_the_line_comes_back():
    from tutel.ops.decode_lines import lines_in_effect
    module = load_benchmark()
    with fake_cuda(), lines_in_effect([]):  # the kernel's limits, whatever line is shipped
        call = _routed_call(16)
        with OperatorCount() as as_is:
            call()
        with OperatorCount() as moved:
            module.with_line(call, 0)()
        with pytest.raises(RuntimeError, match="inside"):
            with module.decode_line_at(0):
                raise RuntimeError("inside")
        with OperatorCount() as after:
            call()
    assert as_is.operators == [DECODE] and after.operators == [DECODE]
    assert DECODE not in moved.operators and "tutel.group_by_expert.default" in moved.operators


def test_the_decode_candidate_runs_the_kernel_past_a_measured_line(monkeypatch):
    """A run measures both sides of the line in effect: its decode candidate takes the kernel where
    a shipped line would send the call to the grouped path."""
    import tutel.ops.decode_experts as decode_module
    import tutel.ops.decode_lines as decode_lines
    module = load_benchmark()
    monkeypatch.setattr(decode_lines, "device_capability", lambda device: "9.0")
    line = decode_lines.DecodeLine("9.0", "bfloat16", 1.0, "a GPU", "a run")  # 16 tokens x 2 / 8 experts: 4 rows
    with fake_cuda(), decode_lines.lines_in_effect([line]):
        call = _routed_call(16)
        with OperatorCount() as as_shipped:
            call()
        with OperatorCount() as decode:
            module.with_line(call, decode_module.DECODE_MAX_TOKENS)()
        taken = module.decode_taken(16, 2, 8, torch.bfloat16, torch.device("cuda"), decode_module.DECODE_MAX_TOKENS)
    assert DECODE not in as_shipped.operators and decode.operators == [DECODE] and taken


def test_smoke_run_writes_every_case(tmp_path):
    threads = torch.get_num_threads()
    try:
        returned = load_benchmark().main(["--smoke", "--device", "cpu", "--tokens", "1,4", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    with open(tmp_path / "decode_line_cpu.json") as handle:
        written = json.load(handle)
    assert written["benchmark"] == "decode_line_cpu" and written["smoke"] is True
    assert written["decode_max_tokens"] == returned["decode_max_tokens"] > 0
    rows = written["rows"]
    assert {(row["family"], row["T"]) for row in rows} == {(f, t) for f in ("qwen3_moe", "mixtral", "deepseek_v3",
                                                                            "gpt_oss") for t in (1, 4)}
    for row in rows:
        assert row["decode_ms"] > 0 and row["grouped_ms"] > 0 and row["limit_ms"] > 0
        assert row["decode_taken"] is False  # no decode kernel on a CPU: both candidates run one operator
        assert row["decode_vs_grouped"] == 0.0
        assert row["decode_graph_ms"] is None and row["grouped_graph_ms"] is None
    assert len(written["lines"]) == 4 and all(line["graph_line_T"] is None for line in written["lines"])
    report = importlib.import_module("report")
    text = report.gpu_section({"decode_line_cuda": dict(written, device_name="a GPU")})
    section = text[text.index("### The decode kernel against the grouped path"):]
    assert "on a GPU (torch" in section and f"limit at {written['decode_max_tokens']} tokens" in section
    tables = [line for line in section.splitlines() if line.startswith("| family |")]
    assert len(tables) == 2 and " grouped/decode |" in tables[0] and " eager_line_T |" in tables[1]
    assert sum(line.startswith("| gpt_oss |") for line in section.splitlines()) == 3  # 2 cases and its line
