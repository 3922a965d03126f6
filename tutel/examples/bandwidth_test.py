#!/usr/bin/env python3
"""Measures the bandwidth of AllToAll, AllReduce, AllGather and ReduceScatter across the processes.

    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.bandwidth_test --device cpu --size_mb 16

Every loop prints, on global rank 0, one line per collective:
``<Name> bandwidth across W node(s) = X GB/s`` where X is the size of the
buffer (``--size_mb``) divided by the time of one call, then a blank line.
"""
import argparse
import time

import torch

from tutel import net, system


def parse_args(argv=None) -> argparse.Namespace:
    """The command-line flags (--device, --size_mb, --loop)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--size_mb", type=int, default=256, help="buffer size in MiB (float32)")
    parser.add_argument("--loop", type=int, default=50, help="number of rounds")
    args = parser.parse_args(argv)
    if args.size_mb < 1 or args.loop < 1:
        parser.error("--size_mb and --loop must be positive")
    return args


def main(argv=None) -> None:
    """Runs ``--loop`` rounds of the four collectives and prints their bandwidth on rank 0."""
    args = parse_args(argv)
    env = system.init_data_model_parallel(backend="nccl" if args.device == "cuda" else "gloo")
    world = env.global_size
    # float32 elements, rounded up to a multiple of the world size so every collective splits it evenly.
    numel = -(-args.size_mb * 1024 * 1024 // 4 // world) * world
    buffer = torch.randn([numel], dtype=torch.float32, device=env.local_device)
    nbytes = numel * 4
    collectives = (
        ("AllToAll", lambda: net.simple_all_to_all(buffer.view(world, -1))),
        ("AllReduce", lambda: net.simple_all_reduce(buffer)),
        ("AllGather", lambda: net.simple_all_gather(buffer.view(world, -1)[env.global_rank])),
        ("ReduceScatter", lambda: net.simple_reduce_scatter(buffer.view(world, -1))),
    )
    with torch.no_grad():
        for _ in range(args.loop):
            for name, collective in collectives:
                net.barrier()
                start = system.record_time()
                collective()
                seconds = system.record_time() - start
                env.dist_print(f"{name} bandwidth across {world} node(s) = %.4f GB/s" % (nbytes * 1e-9 / seconds))
            env.dist_print("")
            time.sleep(0.5)


if __name__ == "__main__":
    main()
