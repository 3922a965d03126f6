#!/usr/bin/env python3
"""Variable-size all-gather between 2 processes (NCCL on GPUs, gloo on CPUs).

    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.nccl_all_gather_v

Rank 0 contributes [10]*5 and rank 1 [20]*3; both receive [10, 10, 10, 10, 10, 20, 20, 20].
"""
from tutel import net
from tutel.examples._two_processes import rank_values, two_process_session


def main() -> None:
    env = two_process_session()
    input = rank_values(env, {0: [10] * 5, 1: [20] * 3})
    print(f"Device-{env.global_rank} sends: {[input]}")
    net.barrier()
    outputs, _ = net.batch_all_gather_v([input])
    print(f"Device-{env.global_rank} recvs: {outputs}")


if __name__ == "__main__":
    main()
