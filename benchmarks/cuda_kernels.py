"""Bandwidth of tutel's CUDA kernels against a device-to-device copy.

For each operator and shape, the time of one call (CUDA events, median over
repetitions) and the bytes it must move at the least (every input row it reads
once, every output it writes) give an achieved bandwidth; the reference is a
measured copy of a large buffer (`dst.copy_(src)`, bytes read + written).
Prints a table and writes JSON (default benchmarks/results/cuda_kernels.json).

    python benchmarks/cuda_kernels.py [--dtypes float32,bfloat16] [--reps 20] [--smoke]

The shapes are the seeds' layer (32 x 1024 tokens, model_dim 2048, top-2) and a
many-expert one (64 experts, top-8), both at capacity factor 1.0.
"""
import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import tutel  # noqa: E402
from tutel.rules.capacity import expert_capacity  # noqa: E402

SHAPES = {  # name: (tokens, experts, top_k, model_dim)
    "seed top-2": (32 * 1024, 8, 2, 2048),
    "64 experts top-8": (32 * 1024, 64, 8, 2048),
}
SMOKE_SHAPES = {"smoke": (1024, 8, 2, 256)}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def time_ms(fn: Callable[[], object], reps: int, inner: int = 5) -> float:
    """Median milliseconds of one call, timed with CUDA events over `inner` calls per repetition."""
    fn()  # compiles and loads on first use
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def copy_bandwidth(reps: int, bytes_: int) -> float:
    """GB/s of a device-to-device copy, counting the bytes read and written."""
    src = torch.empty(bytes_, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps)
    return 2 * bytes_ / ms / 1e6


def operator_cases(tokens: int, experts: int, top_k: int, model_dim: int, dtype: torch.dtype) -> List[Dict]:
    """Each case: name, the call, and the least bytes it moves."""
    ops = torch.ops.tutel
    size = torch.empty((), dtype=dtype).element_size()
    acc_size = 8 if dtype == torch.float64 else 4
    scores = torch.randn(tokens, experts, device="cuda").softmax(1).to(dtype)
    indices, gates, locations, _ = ops.route_topk(scores, top_k, False)
    capacity = expert_capacity(1.0, top_k, tokens, experts)
    kept = int((locations < capacity).sum())
    weights = gates.to(torch.float64 if dtype == torch.float64 else torch.float32)
    x = torch.randn(tokens, model_dim, device="cuda", dtype=dtype)
    buffer = torch.randn(experts, capacity, model_dim, device="cuda", dtype=dtype)
    table = 2 * 4 * top_k * tokens  # indices + locations
    token_rows, slot_rows = tokens * model_dim * size, experts * capacity * model_dim * size
    kept_rows = kept * model_dim * size
    mask = torch.randint(0, 2, (tokens, experts), device="cuda", dtype=torch.int32)
    return [
        dict(name="route_topk", call=lambda: ops.route_topk(scores, top_k, False),
             bytes=tokens * experts * size + top_k * tokens * (4 + size + 4) + top_k * experts * 4),
        dict(name="route_topk (batch-prioritized)", call=lambda: ops.route_topk(scores, top_k, True),
             bytes=tokens * experts * size + top_k * tokens * (4 + size + 4) + top_k * experts * 4),
        dict(name="encode (scatter_slots)", call=lambda: ops.scatter_slots(x, indices, locations, None, None,
                                                                           experts, capacity),
             bytes=kept_rows + slot_rows + table),
        dict(name="decode (gather_slots)", call=lambda: ops.gather_slots(buffer, indices, locations, weights, None),
             bytes=kept_rows + token_rows + table + top_k * tokens * acc_size),
        dict(name="encode backward (gather + dots)",
             call=lambda: ops.gather_slots(buffer, indices, locations, None, x),
             bytes=kept_rows + 2 * token_rows + table + top_k * tokens * acc_size),
        dict(name="decode backward (scatter + dots)",
             call=lambda: ops.scatter_slots(x, indices, locations, weights, buffer, experts, capacity),
             bytes=2 * kept_rows + slot_rows + table + 2 * top_k * tokens * acc_size),
        dict(name="cumsum_sub_one (int32 mask)", call=lambda: ops.cumsum_sub_one(mask),
             bytes=tokens * experts * (4 + 8)),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16,float16", help="comma-separated dtypes")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per case")
    parser.add_argument("--smoke", action="store_true", help="one small shape, 2 repetitions")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cuda_kernels.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not tutel.cuda.is_built():
        print("cuda_kernels.py needs a CUDA device and tutel built with CUDA support.", file=sys.stderr)
        return 2
    reps = 2 if args.smoke else args.reps
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    copy_gbps = copy_bandwidth(reps, (64 if args.smoke else 1024) * 2 ** 20)
    nvrtc_path, nvrtc_major, nvrtc_minor = tutel.cuda.nvrtc_info()
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                  nvrtc=f"{nvrtc_major}.{nvrtc_minor}", copy_gbps=copy_gbps, results=[])
    print(f"device: {report['device']}   torch {report['torch']}   NVRTC {report['nvrtc']}")
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)\n")
    print(f"{'shape':18} {'dtype':9} {'operator':34} {'time ms':>9} {'GB/s':>8} {'of copy':>8}")
    for shape_name, shape in shapes.items():
        for dtype_name in args.dtypes.split(","):
            for case in operator_cases(*shape, DTYPES[dtype_name]):
                ms = time_ms(case["call"], reps)
                gbps = case["bytes"] / ms / 1e6
                report["results"].append(dict(shape=shape_name, tokens=shape[0], experts=shape[1], top_k=shape[2],
                                              model_dim=shape[3], dtype=dtype_name, operator=case["name"],
                                              ms=ms, bytes=case["bytes"], gbps=gbps, fraction_of_copy=gbps / copy_gbps))
                print(f"{shape_name:18} {dtype_name:9} {case['name']:34} {ms:9.4f} {gbps:8.0f} {gbps / copy_gbps:8.1%}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
