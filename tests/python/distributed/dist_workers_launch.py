"""A program for the launch tests: joins the group, all-reduces, prints what it sees.

    mpiexec -n 2 python3 -m tutel.launcher.run -m dist_workers_launch
    mpiexec -n 2 python3 -m dist_workers_launch          (OpenMPI rendezvous, no torchrun)
"""
import os
import sys

import torch

from tutel import net, system


def main() -> None:
    env = system.init_data_model_parallel(backend="gloo")
    total = net.simple_all_reduce(torch.tensor([float(env.global_rank + 1)]))
    # One write per line: the lines of several processes share one pipe.
    sys.stdout.write(f"launched rank {env.global_rank} of {env.global_size}: sum = {total.item():g}, "
                     f"LOCAL_SIZE = {os.environ.get('LOCAL_SIZE')}, "
                     f"TUTEL_CUDA_SANDBOX = {os.environ.get('TUTEL_CUDA_SANDBOX')}, "
                     f"rendezvous = {'torchrun' if 'LOCAL_RANK' in os.environ else 'openmpi'}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
