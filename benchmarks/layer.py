"""Forward + backward step time and peak memory of tutel.moe.moe_layer against the ideal (the
gate GEMM plus the experts on tokens already laid out as [E, C, M]) and a naive GShard-style
layer, measured in the same run.

    python benchmarks/layer.py            # full sizes, writes benchmarks/results/layer.json
    python benchmarks/layer.py --smoke    # tiny sizes, one repetition
"""
import sys
from typing import Dict, Optional, Sequence

import torch

from _common import (add_memory, config_child, interleaved_medians, load_average, measure_rows, memory_child,
                     parse_args, peak_memory_mib, write_result)
from _models import LayerCase, time_case, time_case_under_glibc

# (T, M, H, E, k)
SHAPES = [(4096, 512, 1024, 8, 2), (4096, 512, 256, 64, 2), (2048, 1024, 512, 32, 8)]
SMOKE_SHAPES = [(64, 16, 32, 4, 2), (48, 8, 16, 8, 3)]
# The shape whose per-operator profile docs/performance.md breaks down.
PROFILED_SHAPE = SHAPES[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_time(shape, dtype_name: str, reps: int) -> Dict[str, object]:
    load = load_average()
    row = time_case(LayerCase(*shape, DTYPES[dtype_name]), reps)
    row.update(dtype=dtype_name, load_before=load)
    return row


def measure_glibc(shape, dtype_name: str, reps: int) -> Dict[str, object]:
    return time_case_under_glibc(LayerCase(*shape, DTYPES[dtype_name]), reps)


def measure_memory(row: Dict[str, object]) -> None:
    """Adds each candidate's peak step memory (inputs and gradients included) to `row`."""
    case = LayerCase(row["T"], row["M"], row["H"], row["E"], row["k"], DTYPES[row["dtype"]])
    for name in ("layer", "ideal", "naive"):
        if f"{name}_ms" in row:
            case.step_with_fresh_inputs(name)()  # first call: lazily built state is not counted
            row[f"{name}_peak_mib"] = peak_memory_mib(case.step_with_fresh_inputs(name))
    if row.get("layer_peak_mib") is not None and row.get("ideal_peak_mib"):
        row["layer_mem/ideal_mem"] = row["layer_peak_mib"] / row["ideal_peak_mib"]


def profile_ops(shape, steps: int) -> Dict[str, float]:
    """Self CPU milliseconds per layer step of each operator (fp32), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    case = LayerCase(*shape, torch.float32)
    step = case.steps(include_naive=False)["layer"]
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    per_step = {event.key: event.self_cpu_time_total / 1e3 / steps for event in prof.key_averages()}
    return {name: ms for name, ms in sorted(per_step.items(), key=lambda item: -item[1]) if ms >= 0.01}


def roofline(reps: int, smoke: bool) -> Dict[str, float]:
    """This machine's fp32 GEMM rate and copy bandwidth (the bounds kernels are compared with)."""
    rows, inner, cols = (64, 32, 64) if smoke else (4096, 512, 1024)
    a, b = torch.randn(rows, inner), torch.randn(inner, cols)
    out = torch.empty(rows, cols)
    source = torch.randn(64 if smoke else 4 << 20)
    target = torch.empty_like(source)
    times = interleaved_medians({"gemm": lambda: torch.mm(a, b, out=out), "copy": lambda: target.copy_(source)}, reps)
    return {"gemm_gflops": 2 * rows * inner * cols / times["gemm"] / 1e9,
            "copy_gbps": 2 * source.numel() * 4 / times["copy"] / 1e9}


COLUMNS = ["T", "M", "H", "E", "k", "dtype", "layer_ms", "ideal_ms", "naive_ms", "layer/ideal", "layer/ideal_glibc",
           "naive/layer", "tokens_per_s", "layer_peak_mib", "ideal_peak_mib", "naive_peak_mib", "layer_mem/ideal_mem",
           "extra_fault_mib", "foreign_cpus"]


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(__doc__.splitlines()[0], argv, default_reps=10)
    if config_child(args, measure_time, measure_glibc) or memory_child(args, measure_memory):
        return {}
    configs = [(shape, dtype_name, args.reps) for shape in (SMOKE_SHAPES if args.smoke else SHAPES)
               for dtype_name in DTYPES]
    rows = measure_rows(configs, measure_time, COLUMNS, glibc_row=measure_glibc, script=__file__)
    profiled = SMOKE_SHAPES[0] if args.smoke else PROFILED_SHAPE
    timing = {"roofline": roofline(args.reps, args.smoke),
              "profile": {"shape": dict(zip("TMHEk", profiled)), "ms_per_step": profile_ops(profiled, args.reps)}}
    add_memory(rows, measure_memory, COLUMNS, __file__)
    result = {"rows": rows, "reps": args.reps, "columns": COLUMNS, **timing}
    write_result(args.out, "layer", result, args.smoke)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
