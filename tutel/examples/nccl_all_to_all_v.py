#!/usr/bin/env python3
"""Variable-size all-to-all between 2 processes (NCCL on GPUs, gloo on CPUs).

    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.nccl_all_to_all_v

Rank 0 sends [10]*5 split as [1, 4]; rank 1 sends [20]*3 split as [2, 1].
Rank 0 receives [10, 20, 20] and rank 1 [10, 10, 10, 10, 20].
"""
from tutel import net
from tutel.examples._two_processes import rank_values, two_process_session


def main() -> None:
    env = two_process_session()
    input = rank_values(env, {0: [10] * 5, 1: [20] * 3})
    send_counts = rank_values(env, {0: [1, 4], 1: [2, 1]})
    print(f"Device-{env.global_rank} sends: {[input]}")
    net.barrier()
    outputs, _ = net.batch_all_to_all_v([input], send_counts)
    print(f"Device-{env.global_rank} recvs: {outputs}")


if __name__ == "__main__":
    main()
