"""Process-level helpers: ``from tutel import system``.

``init_data_model_parallel`` joins the process group (torchrun's env://, an
``mpiexec`` launch, or a single process), splits it into data and model groups
and becomes the session that ``record_time`` and ``get_local_session`` use.
Also: ``cache()`` (a process-wide key/value store), ``save`` / ``load`` (tensors as
numpy ``.npy`` files) and ``apply_rank_size_from_pattern`` (per-rank file names).
"""
import atexit
import logging
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Union

import torch

from .collectives.process_groups import ParallelEnv, create_groups_from_world, is_distributed, release_cached_groups

_session: Optional[ParallelEnv] = None
_exit_hook_registered = False


def _on_exit() -> None:
    global _session
    sys.stdout.flush()
    sys.stderr.flush()
    _session = None
    release_cached_groups()
    if is_distributed():
        try:
            torch.distributed.destroy_process_group()
        except (RuntimeError, ValueError):
            pass


def init_data_model_parallel(group_count: int = 1, backend: str = "nccl") -> ParallelEnv:
    """Joins the process group and splits it into ``group_count`` model groups.

    Args:
        group_count: number of model groups (data-parallel degree); -S asks for
            model groups of S ranks.  Must divide the world size.
        backend: 'nccl' (CUDA; falls back to 'gloo' with a warning when CUDA is
            not available), 'gloo' (CPU) or 'mpi'.

    Returns:
        the ParallelEnv with ``global_size, global_rank, group_count, data_rank,
        model_size, model_rank, local_device, data_group, model_group,
        global_group, is_distributed, dist_print, is_cuda``.  It logs
        ``Registering device global rank R: data_rank = D, model_rank = M`` at
        CRITICAL level and becomes the session of ``get_local_session()``.  At
        exit, stdio is flushed and the process group destroyed.
    """
    global _session, _exit_hook_registered
    env = create_groups_from_world(group_count=group_count, include_init=backend)
    logging.critical(f"Registering device global rank {env.global_rank}: "
                     f"data_rank = {env.data_rank}, model_rank = {env.model_rank}")
    _session = env
    if not _exit_hook_registered:
        atexit.register(_on_exit)
        _exit_hook_registered = True
    return env


def get_local_session() -> ParallelEnv:
    """The ParallelEnv of the last ``init_data_model_parallel`` call (raises RuntimeError before it)."""
    if _session is None:
        raise RuntimeError("no session: call tutel.system.init_data_model_parallel() first, or pass is_cuda to "
                           "record_time(is_cuda=...)")
    return _session


def record_time(is_cuda: Optional[bool] = None) -> float:
    """``time.time()`` after waiting for the CUDA device when ``is_cuda`` (default: the session's)."""
    if is_cuda is None:
        is_cuda = get_local_session().is_cuda
    if is_cuda:
        torch.cuda.synchronize()
    return time.time()


class LocalCache:
    """A process-wide key/value store (the fairseq integration collects ``l_aux`` values in it)."""

    _values: Dict[Any, Any] = {}

    @staticmethod
    def reset() -> None:
        """Forgets every value."""
        LocalCache._values = {}

    @staticmethod
    def set(key: Any, value: Any) -> None:
        """Stores ``value`` under ``key``."""
        LocalCache._values[key] = value

    @staticmethod
    def get(key: Any = None) -> Union[Any, List[Any]]:
        """The value stored under ``key``; for a key never stored (or None), the list of all values."""
        if key is not None and key in LocalCache._values:
            return LocalCache._values[key]
        return list(LocalCache._values.values())


def cache() -> type:
    """The process-wide LocalCache (``cache().set(k, v)``, ``cache().get(k)``, ``cache().reset()``)."""
    return LocalCache


def save(tensor: torch.Tensor, path: str) -> None:
    """Saves ``tensor`` as a numpy ``.npy`` file (bfloat16, which numpy lacks, is saved as float32 exactly)."""
    import numpy

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tutel.system.save: `t` must be a torch.Tensor, got {type(tensor).__name__}")
    value = tensor.detach().cpu()
    if value.dtype == torch.bfloat16:
        value = value.float()
    numpy.save(path, value.numpy())


def load(path: str, device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """Loads a ``.npy`` file written by ``save`` as a tensor on ``device`` (default CPU)."""
    import numpy

    return torch.from_numpy(numpy.load(path)).to(device)


def apply_rank_size_from_pattern(filename: str, rank: int, size: int, create_dir: bool = True) -> str:
    """Replaces ``{rank}`` and ``{size}`` in ``filename``; creates its directory when ``create_dir``.

    Warns when the pattern has no ``{rank}`` (every rank would use the same file).
    """
    if not isinstance(filename, str):
        raise TypeError(f"tutel.system.apply_rank_size_from_pattern: `filename` must be a str, got "
                        f"{type(filename).__name__}")
    if "{rank}" not in filename:
        logging.warning("Keyword `{rank}` is not found in file pattern: %s, which may cause collision in file "
                        "access.", filename)
    filename = filename.replace("{rank}", str(rank)).replace("{size}", str(size))
    directory = os.path.dirname(filename)
    if create_dir and directory:
        os.makedirs(directory, exist_ok=True)
    return filename


def init_affinity_at_program_beginning() -> None:
    """Pins this process to the CPUs of one NUMA node, chosen from LOCAL_RANK // NUMA_TYPE.

    Does nothing when ``TUTEL_CUDA_SANDBOX`` is set, when ``NUMA_TYPE`` <= 0, or
    where the NUMA layout cannot be read (a warning is logged on local rank 0).
    """
    if int(os.environ.get("TUTEL_CUDA_SANDBOX", 0)):
        return
    numa_type = int(os.environ.get("NUMA_TYPE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if numa_type <= 0:
        return
    root = "/sys/devices/system/node"
    try:
        nodes = sorted(int(name[4:]) for name in os.listdir(root) if re.fullmatch(r"node[0-9]+", name))
        chosen = nodes[(local_rank // numa_type) % len(nodes)]
        cpus = sorted(int(name[3:]) for name in os.listdir(f"{root}/node{chosen}")
                      if re.fullmatch(r"cpu[0-9]+", name))
        os.sched_setaffinity(0, cpus)
        logging.info("LOCAL_RANK %d is bound to NUMA node %d (of %d)", local_rank, chosen, len(nodes))
    except (OSError, ValueError, ZeroDivisionError, IndexError) as error:
        if local_rank == 0:
            logging.warning("Failed to set NUMA affinity: %s", error)
