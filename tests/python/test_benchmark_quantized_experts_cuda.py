"""benchmarks/quantized_experts.py --device cuda, checked on a CPU: the refusal without a CUDA device,
the cases a GPU run measures, and one case's row built on the CPU with the device parts (CUDA events,
graph captures, the profiler's kernel count) replaced by stand-ins on a fake clock.  What only a GPU can
show (the times, which captures succeed) is left to the run itself (benchmarks/run_on_gpu.sh).  No
timing is checked here."""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmark_scripts import BENCHMARKS_DIR, FakeClock, load_script

REPO = os.path.dirname(BENCHMARKS_DIR)
if BENCHMARKS_DIR not in sys.path:
    sys.path.insert(0, BENCHMARKS_DIR)

pytest.importorskip("transformers")
cuda_timing = importlib.import_module("cuda_timing")


def load_benchmark():
    return load_script("quantized_experts", "tutel_benchmark_quantized_experts_cuda")


def test_the_cli_refuses_cuda_without_a_device_and_writes_nothing(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device, on any machine
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS_DIR, "quantized_experts.py"), "--device", "cuda",
                             "--smoke", "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "quantized_experts.py --device cuda needs a CUDA device" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())


def test_an_unknown_device_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        load_benchmark().main(["--device", "tpu", "--smoke"])
    assert "--device" in capsys.readouterr().err


def test_the_cases_of_a_gpu_run():
    bench = load_benchmark()
    cases = bench.cuda_cases(smoke=False)
    assert [(c["model"], c["T"]) for c in cases] == [(m, t) for m in ("gpt-oss-20b", "Qwen3-30B-A3B")
                                                     for t in (1, 16, 2048)]
    by_model = {c["model"]: c for c in cases}
    gpt_oss, qwen3 = by_model["gpt-oss-20b"], by_model["Qwen3-30B-A3B"]
    assert gpt_oss["format"] == "mxfp4" and qwen3["format"] == "fp8_block"
    assert gpt_oss["candidates"] == ["bf16", "mxfp4", "nvfp4", "fp8_block"] and not gpt_oss["fp8_experts"]
    # transformers 5.x: the module's own forward and the implementations registered for FP8 experts
    assert {"hf_fp8_tutel", "hf_fp8_tutel_weight_only", "hf_fp8_eager", "hf_fp8_grouped_mm",
            "hf_fp8_batched_mm"} <= set(qwen3["candidates"])
    assert "hf_fp8_deepgemm_megamoe" in qwen3["left_out"] and "hf_fp8_deepgemm_megamoe" not in qwen3["candidates"]



class FakeGraph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


COSTS_MS = {"bf16": 2.0, "mxfp4": 0.5, "nvfp4": 0.6, "fp8_block": 0.8, "hf_fp8_tutel": 1.0,
            "hf_fp8_tutel_weight_only": 0.9, "read_probe": 0.25}


def stand_ins(bench, monkeypatch, fail_capture=("nvfp4",)):
    """Replaces the device parts of `bench`: event timing on a fake clock (each candidate costs
    COSTS_MS, a replay half of it), captures that fail for `fail_capture`; returns the flush log."""
    clock, flushes = FakeClock(), []

    def event_medians(candidates, reps, warmup=1, before_each=None, replay=False):
        def costed(name, fn):
            def run():
                fn()
                clock.now += COSTS_MS.get(name, 3.0) * (0.5 if replay else 1.0)
            return run
        return cuda_timing.interleaved_event_medians({name: costed(name, fn) for name, fn in candidates.items()}, reps,
                                                     warmup, make_event=clock.event, before_each=before_each)

    def capture(fn, warmup=3):
        if any(fn is calls[name] for name in fail_capture):
            return None, "operation not permitted when stream is capturing"
        return cuda_timing.CapturedGraph(FakeGraph(fn), fn()), None

    calls = {}

    def graphs(case_calls, reps, medians):
        calls.update(case_calls)
        replay_medians = lambda replays, n: medians.func(replays, n, replay=True, **medians.keywords)  # noqa: E731
        return cuda_timing.graph_replay_fields(case_calls, reps, capture=capture, medians=replay_medians)

    monkeypatch.setattr(bench, "interleaved_event_medians", event_medians)
    monkeypatch.setattr(bench, "graph_replay_fields", graphs)
    return flushes


def test_a_qwen3_case_on_stand_ins(monkeypatch, keep_threads):
    """The wiring of measure_cuda_case on a smoke-sized Qwen3 layer on the CPU: eager and replayed
    times, kernels, read limits from the probe's time, ratios; transformers' FP8 implementations
    that do not run here recorded with their error, and the targets judged from the row."""
    bench = load_benchmark()
    torch.set_num_threads(1)
    flushes = stand_ins(bench, monkeypatch)
    layer = bench.LAYERS[1]
    weights = bench.layer_weights(layer, smoke=True, device="cpu")
    modules = bench.fp8_experts_modules(weights.config, *weights.stacks["fp8_block"])
    backends = bench.fp8_experts_backends()
    probes = bench.LimitProbes(torch.bfloat16, smoke=True, device="cpu")
    row = bench.measure_cuda_case(layer, weights, 1, reps=3, probes=probes, flush=lambda: flushes.append(1),
                                  fp8_modules=modules, backends=backends, device="cpu",
                                  count=lambda fn: {"kernels": 2, "memcpy": 0, "memset": 1})
    assert row["model"] == "Qwen3-30B-A3B" and row["format"] == "fp8_block" and row["T"] == 1
    h, i, e, k = 64, 32, 8, 8  # the smoke layer
    assert (row["H"], row["I"], row["E"], row["k"]) == (h, i, e, k) and row["experts_read"] == k
    for name in ("bf16", "mxfp4", "nvfp4", "fp8_block", "hf_fp8_tutel", "hf_fp8_tutel_weight_only"):
        assert row[f"{name}_ms"] == pytest.approx(COSTS_MS[name])
        assert row[f"{name}_kernels"] == 2 and row[f"{name}_copies"] == 1
    eager = [name for name in COSTS_MS if f"{name}_ms" in row]
    replayed = [name for name in eager if row.get(f"{name}_graph_ms") is not None]
    assert len(flushes) == 3 * (len(eager) + 1) + 3 * len(replayed)  # before every timed call (the probe's too)
    assert row["nvfp4_graph_ms"] is None and row["nvfp4_graph_error"].startswith("operation not permitted")
    assert row["fp8_block_graph_ms"] == pytest.approx(COSTS_MS["fp8_block"] / 2)
    # the read limit: bytes of the chosen experts' packed tensors over the probe's bytes per second
    read = probes.bytes / (COSTS_MS["read_probe"] / 1e3)
    assert row["read_gbps"] == pytest.approx(read / 1e9)
    mxfp4_bytes = (2 * i * h // 2 + 2 * i * h // 32) + (h * i // 2 + h * i // 32)  # codes + E8M0 scales
    fp8_bytes = 2 * i * h + h * i + 4 * (1 + 1)  # codes + one float32 scale per 128 x 128 block of each
    bf16_bytes = 2 * (2 * i * h + h * i)
    for name, per_expert in (("mxfp4", mxfp4_bytes), ("fp8_block", fp8_bytes), ("bf16", bf16_bytes)):
        limit_ms = k * per_expert / read * 1e3
        assert row[f"{name}_limit_ms"] == pytest.approx(limit_ms), name
        assert row[f"{name}/limit"] == pytest.approx(COSTS_MS[name] / limit_ms)
    assert row["fp8_block_graph/limit"] == pytest.approx(COSTS_MS["fp8_block"] / 2 / row["fp8_block_limit_ms"])
    assert row["mxfp4/bf16"] == pytest.approx(0.25) and row["nvfp4_graph/bf16_graph"] is None
    # transformers' FP8 kernels come from the kernels hub: each implementation either ran or says why not
    hf = [f"hf_fp8_{name}" for name, why in backends.items() if why is None]
    assert hf and all(f"{name}_ms" in row or row["skipped"].get(name) for name in hf)
    if not any(f"{name}_ms" in row for name in hf):
        assert row["best_hf_fp8"] is None and row["best_hf_fp8/tutel"] is None
        assert row["why/best_hf_fp8/tutel"].startswith("no FP8 experts implementation of transformers ran (")
    verdicts = {v["target"]: v for v in bench.judge([row], smoke=True, targets=bench.CUDA_TARGETS)}
    graph = verdicts["fp8_block_graph/limit <= 1.5"]
    assert graph["value"] == row["fp8_block_graph/limit"] and graph["met"] == (graph["value"] <= 1.5)
    assert "fp8_block/bf16 <= 1.1" not in verdicts  # T = 2048 only (40 under --smoke)
    versus = verdicts["best_hf_fp8/tutel >= 1.2"]
    if row["best_hf_fp8/tutel"] is None:
        assert versus["met"] is None and versus["why"] == row["why/best_hf_fp8/tutel"]
    json.dumps(row)  # the row goes into the JSON as it is


def test_a_gpt_oss_case_has_no_fp8_experts_and_a_failed_capture_is_not_judged_as_met(monkeypatch, keep_threads):
    bench = load_benchmark()
    torch.set_num_threads(1)
    stand_ins(bench, monkeypatch, fail_capture=("mxfp4",))
    layer = bench.LAYERS[0]
    weights = bench.layer_weights(layer, smoke=True, device="cpu")
    probes = bench.LimitProbes(torch.bfloat16, smoke=True, device="cpu")
    row = bench.measure_cuda_case(layer, weights, 1, reps=1, probes=probes, flush=None, fp8_modules=None,
                                  backends=bench.fp8_experts_backends(), device="cpu",
                                  count=lambda fn: {"kernels": 2, "memcpy": 0, "memset": 0})
    assert not [key for key in row if "hf_fp8" in key] and "best_hf_fp8/tutel" not in row
    # gpt-oss' biases count in its read limit: float32 [2I] and [H] per expert
    h, i = 64, 32
    mxfp4_bytes = (2 * i * h // 2 + 2 * i * h // 32) + (h * i // 2 + h * i // 32) + 4 * (2 * i + h)
    assert row["mxfp4_limit_ms"] == pytest.approx(row["experts_read"] * mxfp4_bytes / (row["read_gbps"] * 1e9) * 1e3)
    verdicts = bench.judge([row], smoke=True, targets=bench.CUDA_TARGETS)
    assert [(v["target"], v["met"], v["why"]) for v in verdicts] == \
        [("mxfp4_graph/limit <= 1.5", None, "operation not permitted when stream is capturing")]


def test_report_renders_the_gpu_run_with_its_failures_skips_and_targets():
    bench = load_benchmark()
    report = importlib.import_module("report")
    rows = [dict(model="Qwen3-30B-A3B", format="fp8_block", T=t, experts_read=8, bf16_ms=0.4, bf16_graph_ms=0.1,
                 fp8_block_ms=0.2, fp8_block_graph_ms=None, fp8_block_graph_error="operation not permitted when "
                 "stream is capturing", fp8_block_kernels=2, hf_fp8_tutel_ms=0.3, best_hf_fp8=None,
                 skipped={"hf_fp8_grouped_mm": "finegrained-fp8 kernel unavailable"},
                 **{"fp8_block_graph/limit": None, "fp8_block/bf16": 0.5, "best_hf_fp8/tutel": None,
                    "why/best_hf_fp8/tutel": "no FP8 experts implementation of transformers ran"}) for t in (1, 2048)]
    rows.append(dict(model="gpt-oss-20b", format="mxfp4", T=2048, fp8_experts=False, error="CUDA out of memory."))
    result = {"rows": rows, "columns": bench.CUDA_COLUMNS, "kernel_columns": bench.CUDA_KERNEL_COLUMNS,
              "targets": bench.judge(rows, smoke=False, targets=bench.CUDA_TARGETS), "device_name": "NVIDIA H100",
              "machine": {"torch": "2.x"}, "finished": "now",
              "command": "python benchmarks/quantized_experts.py --device cuda"}
    text = report.gpu_section({"quantized_experts_cuda": result})
    section = text[text.index("### Quantized experts on the GPU"):]
    assert "| Qwen3-30B-A3B | fp8_block | 1 | 8 | 0.4 | 0.1 | 0.2 |" in section
    assert " fp8_block_kernels |" in section and " nvfp4_ms |" not in section  # no row has it
    assert "- fp8_block, graph error: `operation not permitted when stream is capturing` (Qwen3-30B-A3B fwd T=1, " \
           "Qwen3-30B-A3B fwd T=2048)" in section
    assert "- hf_fp8_grouped_mm: finegrained-fp8 kernel unavailable" in section
    assert "| Qwen3-30B-A3B | 2048 | fp8_block/bf16 <= 1.1 | 0.5 | yes |" in section
    assert "| Qwen3-30B-A3B | 1 | fp8_block_graph/limit <= 1.5 |  | not measured: operation not permitted when " \
           "stream is capturing |" in section
    assert "best_hf_fp8/tutel >= 1.2 |  | not measured: no FP8 experts implementation of transformers ran |" in section
    assert "- gpt-oss-20b T=2048: the case failed: `CUDA out of memory.`" in section
    assert "| gpt-oss-20b | 2048 | mxfp4/bf16 <= 1.1 |  | not measured: CUDA out of memory. |" in section
    assert "| gpt-oss-20b | 2048 | best_hf_fp8" not in section  # FP8Experts does not hold gpt-oss' layer


def test_a_failed_case_is_judged_not_measured_where_its_targets_apply():
    bench = load_benchmark()
    rows = [dict(model=model, format=fmt, T=1, fp8_experts=fp8, error="CUDA out of memory.")
            for model, fmt, fp8 in (("gpt-oss-20b", "mxfp4", False), ("Qwen3-30B-A3B", "fp8_block", True))]
    verdicts = bench.judge(rows, smoke=False, targets=bench.CUDA_TARGETS)
    assert [(v["model"], v["target"], v["met"], v["why"]) for v in verdicts] == [
        ("gpt-oss-20b", "mxfp4_graph/limit <= 1.5", None, "CUDA out of memory."),
        ("Qwen3-30B-A3B", "fp8_block_graph/limit <= 1.5", None, "CUDA out of memory."),
        ("Qwen3-30B-A3B", "best_hf_fp8/tutel >= 1.2", None, "CUDA out of memory.")]
