"""All-to-all overhead of the MoE layer's exchange against a raw torch.distributed call.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/dist_alltoall.py [--smoke]

For an expert buffer [E, C, M] it times, in the same run and interleaved:
  raw      torch.distributed.all_to_all_single on a contiguous buffer of the same bytes
  net      tutel.net.all_to_all(y, 1, 0) (the layer's forward exchange, with its re-layout)
  overlap  the layer's overlapped path: o chunks sent in the background
and prints medians and ratios (rank 0), writing JSON to benchmarks/results/dist_alltoall.json.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from tutel import net, system


def median_time(function, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    env = system.init_data_model_parallel(backend="gloo")
    world = env.global_size
    shapes = [(world * 2, 64, 32)] if args.smoke else [(world * 4, 1024, 512), (world * 32, 128, 512),
                                                       (world * 2, 4096, 1024)]
    repeat = 1 if args.smoke else args.repeat
    rows = []
    for experts, capacity, model_dim in shapes:
        y = torch.randn(experts, capacity, model_dim)
        flat = torch.randn(y.numel())
        out = torch.empty_like(flat)
        raw = lambda: dist.all_to_all_single(out, flat)
        exchange = lambda: net.all_to_all(y, 1, 0)

        def overlapped(chunks=4):
            pending = [net.all_to_all(c, 1, 0, background=True) for c in y.chunk(chunks, dim=1)]
            return [p() for p in pending]

        for function in (raw, exchange, overlapped):  # warm up
            function()
        times = {"raw": [], "net": [], "overlap4": []}
        for _ in range(3):  # interleave so load changes hit all three
            times["raw"].append(median_time(raw, repeat))
            times["net"].append(median_time(exchange, repeat))
            times["overlap4"].append(median_time(overlapped, repeat))
        best = {k: min(v) for k, v in times.items()}
        rows.append(dict(experts=experts, capacity=capacity, model_dim=model_dim, bytes=y.numel() * 4,
                         raw_ms=best["raw"] * 1e3, net_ms=best["net"] * 1e3, overlap4_ms=best["overlap4"] * 1e3,
                         net_over_raw=best["net"] / best["raw"], overlap4_over_raw=best["overlap4"] / best["raw"]))
    if env.global_rank == 0:
        print(f"world_size = {world}, backend = gloo, threads per process = {torch.get_num_threads()}")
        print("| E | C | M | MiB | raw a2a ms | net.all_to_all ms | ratio | 4 background chunks ms | ratio |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['experts']} | {r['capacity']} | {r['model_dim']} | {r['bytes'] / 2**20:.1f} | "
                  f"{r['raw_ms']:.2f} | {r['net_ms']:.2f} | {r['net_over_raw']:.2f} | {r['overlap4_ms']:.2f} | "
                  f"{r['overlap4_over_raw']:.2f} |")
        os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
        with open(os.path.join(os.path.dirname(__file__), "results", "dist_alltoall.json"), "w") as handle:
            json.dump(dict(world_size=world, rows=rows, smoke=args.smoke), handle, indent=1)


if __name__ == "__main__":
    main()
