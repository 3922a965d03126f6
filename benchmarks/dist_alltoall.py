"""All-to-all overhead of the MoE layer's exchange against a raw torch.distributed call.

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/dist_alltoall.py [--smoke] [--out DIR]

For an expert buffer [E, C, M] it times, in the same run and interleaved:
  raw      torch.distributed.all_to_all_single on a contiguous buffer of the same bytes, into a
           preallocated output (the floor: no allocation, no re-layout)
  plain    the same exchange written in plain PyTorch: all_to_all_single into a fresh tensor, then
           the [W, E/W, C, M] -> [E/W, W*C, M] re-layout the layer needs
  net      tutel.net.all_to_all(y, 1, 0) (the layer's forward exchange, with its re-layout)
  overlap  the layer's overlapped path: o chunks sent in the background
and prints medians and ratios (rank 0), writing JSON to DIR/dist_alltoall.json (default benchmarks/results).
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from tutel import net, system

from _common import format_table, retain_freed_memory

COLUMNS = ["experts", "capacity", "model_dim", "mib", "raw_ms", "plain_ms", "net_ms", "net_over_raw", "net_over_plain",
           "overlap4_ms", "overlap4_over_raw"]


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
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="folder for dist_alltoall.json")
    args = parser.parse_args()
    retain_freed_memory()  # as in the other benchmarks: a fresh 64 MiB block must not fault its pages in per call
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

        def plain():
            received = torch.empty_like(y)
            dist.all_to_all_single(received, y)
            return received.view(world, experts // world, capacity, model_dim).transpose(0, 1).reshape(
                experts // world, world * capacity, model_dim)

        def overlapped(chunks=4):
            pending = [net.all_to_all(c, 1, 0, background=True) for c in y.chunk(chunks, dim=1)]
            return [p() for p in pending]

        for function in (raw, plain, exchange, overlapped):  # warm up
            function()
        times = {"raw": [], "plain": [], "net": [], "overlap4": []}
        for _ in range(3):  # interleave so load changes hit all of them
            times["raw"].append(median_time(raw, repeat))
            times["plain"].append(median_time(plain, repeat))
            times["net"].append(median_time(exchange, repeat))
            times["overlap4"].append(median_time(overlapped, repeat))
        best = {k: min(v) for k, v in times.items()}
        rows.append(dict(experts=experts, capacity=capacity, model_dim=model_dim, mib=y.numel() * 4 / 2**20,
                         raw_ms=best["raw"] * 1e3, plain_ms=best["plain"] * 1e3, net_ms=best["net"] * 1e3,
                         overlap4_ms=best["overlap4"] * 1e3, net_over_raw=best["net"] / best["raw"],
                         net_over_plain=best["net"] / best["plain"], overlap4_over_raw=best["overlap4"] / best["raw"]))
    if env.global_rank == 0:
        print(f"world_size = {world}, backend = gloo, threads per process = {torch.get_num_threads()}")
        print(format_table(rows, COLUMNS))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dist_alltoall.json"), "w") as handle:
            json.dump(dict(world_size=world, threads=torch.get_num_threads(), rows=rows, columns=COLUMNS,
                           smoke=args.smoke), handle, indent=1)


if __name__ == "__main__":
    main()
