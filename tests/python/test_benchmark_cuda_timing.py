"""The CUDA-only measurements of benchmarks/transformers_moe.py (kernels per call, CUDA graph replays,
synchronisation checks; helpers in benchmarks/cuda_timing.py), checked on a CPU: the pure-Python parts
directly, the device parts through stand-ins for the profiler, the graph capture, the device events
and the sync debug mode.  What only a GPU can show (that a real capture of each backend succeeds or
fails as recorded) is left to `python benchmarks/transformers_moe.py --device cuda`.  No timing is
checked here."""
import importlib
import sys
from types import SimpleNamespace
from typing import Callable, List

import torch

from benchmark_scripts import BENCHMARKS_DIR, FakeClock, load_script

if BENCHMARKS_DIR not in sys.path:
    sys.path.insert(0, BENCHMARKS_DIR)

cuda_timing = importlib.import_module("cuda_timing")
CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def load_transformers_moe():
    return load_script("transformers_moe", "tutel_benchmark_transformers_moe_cuda_fields")


# ------------------------------------------------------------------------------------ error lines

def test_first_line_skips_blank_lines_and_cuts_long_ones():
    assert cuda_timing.first_line(RuntimeError("\n  CUDA error: operation not permitted  \nadvice\n")) == \
        "CUDA error: operation not permitted"
    assert cuda_timing.first_line(ValueError("")) == "ValueError"
    assert len(cuda_timing.first_line(RuntimeError("x" * 1000))) == cuda_timing.ERROR_CHARS


def test_a_capture_reports_the_error_of_the_captured_call_over_the_capture_end():
    inner = RuntimeError("operation not permitted when stream is capturing\ndetails")
    outer = RuntimeError("operation failed due to a previous error during capture")
    assert cuda_timing.capture_error(inner, outer) == "operation not permitted when stream is capturing"
    assert cuda_timing.capture_error(None, outer) == "operation failed due to a previous error during capture"


# ----------------------------------------------------------------------------------- kernel counts

def event(name: str, device_type=CUDA) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device_type)


def test_only_device_events_count_and_copies_are_not_kernels():
    events = [event("aten::mm", CPU), event("cudaLaunchKernel", CPU), event("cudaMemcpyAsync", CPU),
              event("void cutlass::Kernel<...>(...)"), event("elementwise_kernel"),
              event("Memcpy DtoH (Device -> Pinned)"), event("Memset (Device)"), event("Event Sync"),
              event("Stream Wait Event")]
    assert cuda_timing.count_device_events(events) == {"kernels": 2, "memcpy": 1, "memset": 1}
    assert cuda_timing.classify_device_event("Context Sync") == "sync"


def test_counts_are_per_call():
    events = [event("gemm")] * 6 + [event("Memcpy HtoD (Pageable -> Device)")] * 3
    assert cuda_timing.count_device_events(events, calls=2) == {"kernels": 3, "memcpy": 1.5, "memset": 0}


def test_kernels_per_call_warms_up_then_profiles_the_calls():
    calls: List[int] = []
    counts = cuda_timing.kernels_per_call(lambda: calls.append(torch.ones(4).sum()), calls=3, on_device=False)
    assert len(calls) == 4  # one warm-up, three profiled
    assert counts == {"kernels": 0, "memcpy": 0, "memset": 0}  # a CPU run launches nothing on a device


# -------------------------------------------------------------------------------------- graph capture

def test_a_failed_capture_is_recorded_not_raised():
    def refuses(fn, warmup):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")
    graph, error = cuda_timing.try_capture(lambda: None, capture=refuses)
    assert graph is None and error == "CUDA error: operation not permitted when stream is capturing"


def test_a_capture_that_succeeds_is_handed_back():
    captured = cuda_timing.CapturedGraph(graph="graph", output=torch.ones(2))
    graph, error = cuda_timing.try_capture(lambda: None, warmup=0, capture=lambda fn, warmup: captured)
    assert graph is captured and error is None


def test_the_real_capture_never_raises():
    """Without a GPU the capture fails at its first CUDA call; try_capture turns that into a record."""
    graph, error = cuda_timing.try_capture(lambda: torch.ones(2, device="cuda" if torch.cuda.is_available()
                                                               else "cpu") * 2)
    if torch.cuda.is_available():
        assert error is None and torch.equal(graph.output, torch.full((2,), 2.0, device="cuda"))
    else:
        assert graph is None and error


# ------------------------------------------------------------------------------- event-timed rounds

class CandidateClock(FakeClock):
    """FakeClock with candidates that advance it by their cost and log their names."""

    def candidate(self, cost: float, log: list, name: str) -> Callable[[], None]:
        def run():
            self.now += cost
            log.append(name)
        return run


def test_event_medians_interleave_every_candidate_once_per_round():
    clock, log = CandidateClock(), []
    candidates = {"a": clock.candidate(1.0, log, "a"), "b": clock.candidate(0.25, log, "b"),
                  "c": clock.candidate(4.0, log, "c")}
    medians = cuda_timing.interleaved_event_medians(candidates, reps=5, warmup=2, make_event=clock.event)
    assert medians == {"a": 1.0, "b": 0.25, "c": 4.0}
    assert log[:6] == ["a", "b", "c", "a", "b", "c"]  # warm-up rounds in order
    rounds = [log[i:i + 3] for i in range(6, len(log), 3)]
    assert len(rounds) == 5 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # the order changes between rounds


# -------------------------------------------------------------------------------------- sync checks

class FakeModes:
    def __init__(self, start=0):
        self.mode, self.history = start, []

    def set(self, mode):
        self.mode = mode
        self.history.append(mode)

    def get(self):
        return self.mode


def test_sync_free_runs_each_step_under_error_mode_and_restores_the_mode():
    modes, seen = FakeModes(start="warn"), []
    steps = {"fwd+bwd": lambda: seen.append(("fwd+bwd", modes.mode)), "fwd": lambda: seen.append(("fwd", modes.mode))}
    assert cuda_timing.sync_free(steps, set_mode=modes.set, get_mode=modes.get) == (True, None)
    assert seen == [("fwd+bwd", "warn"), ("fwd", "warn"), ("fwd+bwd", "error"), ("fwd", "error")]
    assert modes.mode == "warn"


def test_sync_free_names_the_step_that_synchronised():
    modes = FakeModes()

    def decode():
        if modes.mode == "error":
            raise RuntimeError("called a synchronizing CUDA operation\nstack ...")
    free, error = cuda_timing.sync_free({"fwd+bwd": lambda: None, "fwd": decode}, set_mode=modes.set,
                                        get_mode=modes.get)
    assert not free and error == "fwd: called a synchronizing CUDA operation"
    assert modes.mode == 0


# ------------------------------------------------------------------------------------ graph outputs

def test_outputs_match_bitwise_within_rounding_or_not():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert cuda_timing.outputs_match(x, x.clone()) == {"bitwise": True, "relative": 0.0, "equal": True}
    nudged = x.clone()
    nudged.view(torch.int16)[0, 0] += 1  # the next bf16 value: one unit in the last place
    match = cuda_timing.outputs_match(x, nudged)
    assert not match["bitwise"] and match["equal"] and 0 < match["relative"] <= torch.finfo(torch.bfloat16).eps
    assert not cuda_timing.outputs_match(x, x * 1.5)["equal"]
    poisoned = x.clone()
    poisoned[3] = float("nan")
    assert not cuda_timing.outputs_match(x, poisoned)["equal"]


# ------------------------------------------------------------------------------ the benchmark's rows

def test_graph_ratios_use_the_fastest_backend_that_captured():
    bench = load_transformers_moe()
    fields = {"eager_graph_ms": None, "grouped_mm_graph_ms": 0.4, "batched_mm_graph_ms": 0.2,
              "tutel_graph_ms": 0.1, "moe_layer_graph_ms": None}
    ratios = bench.graph_ratios(fields, ("eager", "grouped_mm", "batched_mm"), limit_ms=0.05)
    assert ratios == {"best_transformers_graph": "batched_mm", "best_transformers_graph/tutel_graph": 2.0,
                      "tutel_graph/limit": 2.0, "best_transformers_graph/moe_layer_graph": None,
                      "moe_layer_graph/limit": None}
    none = bench.graph_ratios({"eager_graph_ms": None, "tutel_graph_ms": 1.0}, ("eager",), limit_ms=1.0)
    assert none == {"best_transformers_graph": None, "best_transformers_graph/tutel_graph": None,
                    "tutel_graph/limit": 1.0}


def test_kernel_fields_record_a_failed_count_and_go_on():
    bench = load_transformers_moe()

    def count(fn):
        fn()
        return {"kernels": 7, "memcpy": 1, "memset": 2}

    def broken():
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nmore")
    fields = bench.kernel_fields({"tutel": lambda: None, "eager": broken}, count=count)
    assert fields == {"tutel_kernels": 7, "tutel_copies": 3, "eager_kernels": None,
                      "eager_kernels_error": "CUPTI_ERROR_NOT_INITIALIZED"}


class FakeGraph:
    """A 'graph' whose replay runs the call again into the output captured first, as a real replay
    writes into its static output."""

    def __init__(self, fn, output):
        self.fn, self.output = fn, output

    def replay(self):
        out = self.fn()
        if isinstance(self.output, torch.Tensor):
            self.output.copy_(out)


def test_cuda_case_fields_on_stand_ins(monkeypatch, keep_threads):
    """The wiring of cuda_case_fields, on a smoke-sized Qwen3 block on the CPU with the device parts
    replaced: the eager backend's capture fails (as a host read-back makes it fail on a GPU)."""
    bench = load_transformers_moe()
    torch.set_num_threads(1)
    from _hf_blocks import build_block, case_inputs, experts_call, moe_layer_like
    ours = bench.tutel_backend_name()
    block = build_block("qwen3_moe", torch.float32, smoke=True)
    layer = moe_layer_like(block)
    x, indices, weights, grad = case_inputs(block, 5, True)
    backends = ("eager", "grouped_mm", "batched_mm")
    calls = {b: experts_call(block, b, x, indices, weights, True, grad) for b in backends}
    calls["tutel"] = experts_call(block, ours, x, indices, weights, True, grad)
    calls["moe_layer"] = bench._layer_call(layer, x, True, grad)

    def capture(fn, warmup=3):
        if fn is calls["eager"]:
            return None, "operation not permitted when stream is capturing"
        output = fn()
        return cuda_timing.CapturedGraph(FakeGraph(fn, output), output), None

    clock = CandidateClock()
    modes = FakeModes()
    monkeypatch.setattr(bench, "try_capture", capture)
    monkeypatch.setattr(bench, "kernels_per_call", lambda fn: {"kernels": 3, "memcpy": 0, "memset": 1})
    monkeypatch.setattr(bench, "sync_free", lambda steps: cuda_timing.sync_free(steps, modes.set, modes.get))

    def event_medians(candidates, reps):  # every replay takes 0.5 ms on the fake clock
        def costed(fn):
            def run():
                fn()
                clock.now += 0.5
            return run
        return cuda_timing.interleaved_event_medians({name: costed(fn) for name, fn in candidates.items()}, reps,
                                                     make_event=clock.event)
    monkeypatch.setattr(bench, "interleaved_event_medians", event_medians)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    fields = bench.cuda_case_fields(block, layer, ours, calls, backends, (x, indices, weights, grad), reps=2,
                                    limit_ms=0.25)
    for name in calls:
        assert fields[f"{name}_kernels"] == 3 and fields[f"{name}_copies"] == 1
    assert fields["eager_graph_ms"] is None
    assert fields["eager_graph_error"] == "operation not permitted when stream is capturing"
    for name in ("grouped_mm", "batched_mm", "tutel", "moe_layer"):
        assert fields[f"{name}_graph_ms"] == 0.5 and f"{name}_graph_error" not in fields
    assert fields["best_transformers_graph"] in ("grouped_mm", "batched_mm")
    assert fields["best_transformers_graph/tutel_graph"] == 1.0 and fields["tutel_graph/limit"] == 2.0
    assert fields["tutel_sync_free"] is True and fields["moe_layer_sync_free"] is True
    assert modes.history.count("error") == 4 and modes.mode == 0  # two steps of each, the mode put back
    # moe_layer's forward on the CPU is deterministic: the stand-in replay reproduces it bit for bit
    assert fields["moe_layer_graph_equal"] is True and fields["moe_layer_graph_bitwise"] is True
    assert fields["moe_layer_graph_vs_eager"] == 0.0
    assert set(bench.CUDA_COLUMNS) - set(fields) <= {"family", "dtype", "pass", "T", "limit_ms"}


def test_a_cpu_run_records_none_of_the_cuda_fields(tmp_path, keep_threads):
    returned = load_transformers_moe().main(["--smoke", "--threads", "1", "--out", str(tmp_path), "--families",
                                             "mixtral", "--dtypes", "float32", "--tokens", "3",
                                             "--train-tokens", ""])
    assert "cuda_columns" not in returned and len(returned["rows"]) == 1
    row = returned["rows"][0]
    assert row["limit_ms"] > 0 and row["tutel_ms"] > 0
    assert not [key for key in row if "_graph" in key or "_kernels" in key or "_sync" in key]


# ---------------------------------------------------------------------------------------- the report

def gpu_result(rows, with_cuda_columns=True):
    result = {"rows": rows, "columns": ["family", "dtype", "pass", "T", "tutel_ms", "limit_ms"],
              "limits": {"gemm_gflops_bfloat16": 7e5, "read_gbps": 3000.0}, "device_name": "NVIDIA H100",
              "machine": {"cpu": "host", "logical_cpus": 16, "torch": "2.x"}, "finished": "now",
              "command": "python benchmarks/transformers_moe.py --device cuda --out /tmp/x"}
    if with_cuda_columns:
        result["cuda_columns"] = load_transformers_moe().CUDA_COLUMNS
    return result


def test_report_shows_the_graph_table_and_lists_failures():
    report = importlib.import_module("report")
    rows = [dict(family="qwen3_moe", dtype="bfloat16", T=t, limit_ms=0.02, tutel_ms=0.5, tutel_kernels=12,
                 eager_kernels=90, eager_graph_ms=None, eager_graph_error="operation not permitted when stream "
                 "is capturing", tutel_graph_ms=0.05, grouped_mm_graph_ms=0.1, best_transformers_graph="grouped_mm",
                 **{"best_transformers_graph/tutel_graph": 2.0, "pass": "fwd"}, tutel_sync_free=True,
                 moe_layer_sync_free=False, moe_layer_sync_error="fwd: called a synchronizing CUDA operation",
                 moe_layer_graph_equal=None) for t in (1, 16)]
    text = report.gpu_section({"transformers_moe_cuda": gpu_result(rows)})
    table = text[text.index("### Kernels per call, CUDA graph replays"):]
    header = table.splitlines()[2]
    for column in ("tutel_kernels", "eager_kernels", "tutel_graph_ms", "grouped_mm_graph_ms",
                   "best_transformers_graph/tutel_graph", "tutel_sync_free", "moe_layer_graph_equal", "limit_ms"):
        assert f" {column} |" in header, column
    assert "batched_mm_graph_ms" not in header  # no row has it
    assert "- eager, graph error: `operation not permitted when stream is capturing` (qwen3_moe fwd T=1, " \
           "qwen3_moe fwd T=16)" in table
    assert "- moe_layer, sync error: `fwd: called a synchronizing CUDA operation`" in table
    assert "--out" not in text


def test_report_of_a_run_before_the_graph_fields_has_no_graph_table():
    report = importlib.import_module("report")
    rows = [dict(family="qwen3_moe", dtype="bfloat16", T=1, limit_ms=0.02, tutel_ms=0.5, **{"pass": "fwd"})]
    text = report.gpu_section({"transformers_moe_cuda": gpu_result(rows, with_cuda_columns=False)})
    assert "| qwen3_moe | bfloat16 | fwd | 1 |" in text and "### Kernels per call" not in text
