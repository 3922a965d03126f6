"""The setup shared by the two-process examples (nccl_all_to_all_v, nccl_all_gather_v)."""
import torch

from tutel import system
from tutel.collectives.process_groups import ParallelEnv


def two_process_session() -> ParallelEnv:
    """Joins the process group (NCCL with CUDA, else gloo); exits unless there are exactly 2 processes."""
    env = system.init_data_model_parallel(backend="nccl" if torch.cuda.is_available() else "gloo", group_count=1)
    if env.global_size != 2:
        raise SystemExit(f"this example needs exactly 2 processes, got {env.global_size}")
    return env


def rank_values(env: ParallelEnv, value_by_rank: dict) -> torch.Tensor:
    """This rank's entry of ``value_by_rank`` as a tensor on the session's device."""
    return torch.tensor(value_by_rank[env.global_rank], device=env.local_device)
