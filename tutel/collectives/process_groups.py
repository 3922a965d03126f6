"""Process groups: rendezvous, world queries and the data / model split of a group.

Every query works without torch.distributed being initialised (a world of one
process).  Every process group created here (and the default group, when the
rendezvous happens here) uses the timeout ``TUTEL_GLOBAL_TIMEOUT_SEC`` (default
86400 s), so a peer that never reaches a collective makes the others fail with
an error instead of waiting forever.

Rendezvous (``create_groups_from_world(..., include_init=backend)``):

* ``LOCAL_RANK`` unset and ``OMPI_COMM_WORLD_SIZE`` set (a plain ``mpiexec``
  launch): ``tcp://MASTER_ADDR:MASTER_PORT`` with the OpenMPI rank and size
  (``MASTER_PORT`` defaults to 23456; ``MASTER_ADDR`` to 127.0.0.1 when every
  rank runs on one host).
* ``RANK`` and ``WORLD_SIZE`` set (torchrun, or ``tutel.launcher.run``): ``env://``.
* neither: a single process (``is_distributed`` False, groups None).

Backends: ``'nccl'`` (CUDA tensors), ``'gloo'`` (CPU tensors) and ``'mpi'``
(when PyTorch is built with it).  A request for ``'nccl'`` on a machine without
CUDA falls back to ``'gloo'`` with a warning, so scripts written for GPUs run
unchanged on CPUs.  A process uses one backend: asking for another raises.
"""
import atexit
import datetime
import logging
import math
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger("tutel")

TIMEOUT_ENV = "TUTEL_GLOBAL_TIMEOUT_SEC"
DEFAULT_TIMEOUT_SEC = 86400
DEFAULT_OMPI_MASTER_PORT = 23456
SUPPORTED_BACKENDS = ("nccl", "gloo", "mpi")


def is_distributed() -> bool:
    """True when torch.distributed is available and its default group is initialised."""
    return dist.is_available() and dist.is_initialized()


def global_timeout() -> datetime.timedelta:
    """The timeout of every process group and collective: ``TUTEL_GLOBAL_TIMEOUT_SEC`` seconds.

    Read at each call so that a program (or a test) may set it before the
    rendezvous.  Raises ValueError for a value that is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_SEC)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not valid; allowed: a positive number of seconds "
                         f"(default {DEFAULT_TIMEOUT_SEC})")
    return datetime.timedelta(seconds=seconds)


def _is_world(group: Optional[Any]) -> bool:
    return group is None or (is_distributed() and group is dist.group.WORLD)


def _require_member(group: Optional[Any], where: str) -> None:
    if group is not None and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{where}: this process (global rank {dist.get_rank()}) is not a member of `group`; "
                         f"allowed: None (WORLD) or a group that contains this process")


def get_world_size(group: Optional[Any] = None) -> int:
    """Number of processes in ``group`` (default: WORLD); 1 when torch.distributed is not initialised."""
    if not is_distributed():
        return 1
    _require_member(group, "tutel.net.get_world_size")
    return dist.get_world_size(group)


def get_world_rank(group: Optional[Any] = None) -> int:
    """This process's rank in ``group`` (default: WORLD); 0 when torch.distributed is not initialised."""
    if not is_distributed():
        return 0
    _require_member(group, "tutel.net.get_world_rank")
    return dist.get_rank(group)


def group_ranks(group: Optional[Any] = None) -> List[int]:
    """Global ranks of the members of ``group`` in group-rank order ([0] when not distributed)."""
    if not is_distributed():
        return [0]
    _require_member(group, "tutel.net.group_ranks")
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def barrier(group: Optional[Any] = None) -> None:
    """Blocks until every process of ``group`` (default: WORLD) reaches it; no-op for one process."""
    if get_world_size(group) > 1:
        dist.barrier(group=group)


# ---------------------------------------------------------------------------
# Rendezvous and backend
# ---------------------------------------------------------------------------

def resolve_backend(backend: str) -> str:
    """Validates a backend name; 'nccl' without CUDA becomes 'gloo' (with a warning)."""
    if not isinstance(backend, str) or backend.lower() not in SUPPORTED_BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; allowed: {', '.join(map(repr, SUPPORTED_BACKENDS))}")
    backend = backend.lower()
    if backend == "nccl" and not torch.cuda.is_available():
        warnings.warn("backend='nccl' was requested but CUDA is not available: using backend='gloo' (CPU) instead",
                      RuntimeWarning, stacklevel=3)
        return "gloo"
    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError("backend='mpi' is not available in this PyTorch build; allowed here: 'gloo'"
                         + (", 'nccl'" if torch.cuda.is_available() else ""))
    return backend


def rendezvous_kind() -> str:
    """How this process finds its peers: 'openmpi', 'env' (torchrun) or 'none' (single process)."""
    if "LOCAL_RANK" not in os.environ and "OMPI_COMM_WORLD_SIZE" in os.environ:
        return "openmpi"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "env"
    return "none"


def local_rank_from_env() -> int:
    """This process's index on its host (torchrun's LOCAL_RANK or OpenMPI's local rank; default 0)."""
    if rendezvous_kind() == "openmpi":
        return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
    return int(os.environ.get("LOCAL_RANK", 0))


def local_size_from_env() -> Optional[int]:
    """Processes per host: ``LOCAL_SIZE`` (the mpiexec launcher) or torchrun's ``LOCAL_WORLD_SIZE``.

    None when neither is set.  Raises ValueError for a value that is not a positive integer.
    """
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        raw = os.environ.get(name, "").strip()
        if raw:
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"{name}={raw!r} is not valid; allowed: a positive integer (processes per host)")
            return int(raw)
    return None


def _openmpi_init_method() -> Tuple[str, int, int]:
    world_size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    address = os.environ.get("MASTER_ADDR")
    if not address:
        if int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", -1)) != world_size:
            raise ValueError("MASTER_ADDR is not set: an mpiexec launch over several hosts needs "
                             "`-x MASTER_ADDR=<first host>`")
        address = "127.0.0.1"
    port = os.environ.get("MASTER_PORT", str(DEFAULT_OMPI_MASTER_PORT))
    return f"tcp://{address}:{port}", rank, world_size


def _set_cuda_device(backend: str) -> Optional[torch.device]:
    if backend != "nccl":
        return None
    device = torch.device("cuda", min(local_rank_from_env(), torch.cuda.device_count() - 1))
    torch.cuda.set_device(device)
    return device


def initialize_process_group(backend: str) -> bool:
    """Joins the default process group when a rendezvous is configured; returns is_distributed.

    Keeps an existing default group (initialised by the program itself).
    """
    if is_distributed():
        return True
    kind = rendezvous_kind()
    if kind == "none":
        return False
    timeout = global_timeout()
    _set_cuda_device(backend)
    if kind == "openmpi":
        init_method, rank, world_size = _openmpi_init_method()
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ValueError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not: the env:// rendezvous needs all four")
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    return True


# ---------------------------------------------------------------------------
# Splitting a group into model groups (contiguous) and data groups (strided)
# ---------------------------------------------------------------------------

class ParallelEnv:
    """The parallel layout returned by ``create_groups_from_world`` / ``init_data_model_parallel``.

    The parent group (WORLD by default) of ``global_size`` processes is split
    into ``group_count`` model groups of ``model_size`` consecutive ranks
    (``model_group``, ``model_rank``); ranks with the same ``model_rank`` form
    a data group (``data_group``, strided, indexed by ``data_rank``).
    """

    def __init__(self, global_size: int, global_rank: int, group_count: int, local_device: torch.device,
                 data_group: Any, model_group: Any, global_group: Any, is_distributed: bool):
        self.global_size = global_size
        self.global_rank = global_rank
        self.group_count = group_count
        self.model_size = global_size // group_count
        self.model_rank = global_rank % self.model_size
        self.data_rank = global_rank // self.model_size
        self.local_device = local_device
        self.data_group = data_group
        self.model_group = model_group
        self.global_group = global_group
        self.is_distributed = is_distributed
        self.is_cuda = local_device.type == "cuda"

    def dist_print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the process of global rank 0 only (every process when not distributed)."""
        if get_world_rank() == 0:
            print(*args, **kwargs)

    def __repr__(self) -> str:
        fields = ("global_size", "global_rank", "group_count", "data_rank", "model_size", "model_rank",
                  "local_device", "is_distributed")
        return "ParallelEnv(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in fields) + ")"


_process_backend: Optional[str] = None
_group_caches: List[dict] = []


def register_group_cache(cache: dict) -> dict:
    """Registers a module-level dict that holds process groups, so that it is emptied at exit."""
    _group_caches.append(cache)
    return cache


@atexit.register
def release_cached_groups() -> None:
    """Drops the process groups cached by tutel.

    Runs at exit: a process group still referenced from a module when the
    interpreter tears its modules down is destroyed after parts of
    torch.distributed, which can abort the process (seen with gloo after an
    OpenMPI rendezvous).
    """
    for cache in _group_caches:
        cache.clear()


_layout_cache: Dict[Tuple[Any, int, bool], ParallelEnv] = register_group_cache({})


def _resolve_group_count(group_count: Any, size: int, where: str) -> int:
    if isinstance(group_count, bool) or not isinstance(group_count, int) or group_count == 0:
        raise ValueError(f"{where}: group_count={group_count!r} is not valid; allowed: a positive number of "
                         f"groups dividing the group size {size}, or -S for groups of S ranks (S dividing {size})")
    if group_count < 0:
        if size % -group_count != 0:
            raise ValueError(f"{where}: group_count={group_count} asks for groups of {-group_count} ranks, which "
                             f"does not divide the group size {size}; allowed S in -S: "
                             f"{[d for d in range(1, size + 1) if size % d == 0]}")
        return size // -group_count
    if size % group_count != 0:
        raise ValueError(f"{where}: group_count={group_count} does not divide the group size {size}; allowed: "
                         f"{[d for d in range(1, size + 1) if size % d == 0]}")
    return group_count


def _local_device(backend: Optional[str], distributed: bool) -> torch.device:
    if backend is None and distributed:
        backend = "nccl" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        return _set_cuda_device(backend)
    if backend is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _registered_group_count() -> Optional[int]:
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    return len(names) if names is not None else None


def _check_local_creation_is_consistent(parent_group: Any, where: str) -> None:
    # Groups created by members only (use_local_synchronization) are named after
    # their ranks and the number of groups each member has registered; members
    # that disagree on that number would wait for each other until the timeout.
    count = _registered_group_count()
    if count is None:
        return
    counts = [None] * get_world_size(parent_group)
    dist.all_gather_object(counts, count, group=parent_group)
    if len(set(counts)) > 1:
        raise RuntimeError(f"{where}: cannot split `parent_group`: its members have created different numbers of "
                           f"process groups so far ({counts} in group-rank order), so PyTorch would name the new "
                           f"groups differently on each member; create process groups in the same order on every "
                           f"member of the parent group")


def _new_group(ranks: List[int], members_only: bool) -> Any:
    return dist.new_group(ranks=ranks, timeout=global_timeout(), use_local_synchronization=members_only)


def _split_groups(parent_group: Any, num_groups: int, where: str) -> Tuple[Any, Any]:
    """(model_group, data_group) of this process, creating the process groups it needs."""
    ranks = group_ranks(parent_group)
    size, rank = len(ranks), get_world_rank(parent_group)
    model_size = size // num_groups
    blocks = [ranks[b * model_size:(b + 1) * model_size] for b in range(num_groups)]
    strides = [ranks[m::model_size] for m in range(model_size)]
    parent = dist.group.WORLD if parent_group is None else parent_group
    if _is_world(parent_group):
        # Every process of WORLD takes part and creates every group, in the same order.
        model_group = parent if model_size == size else [_new_group(b, False) for b in blocks][rank // model_size]
        data_group = parent if num_groups == size else [_new_group(s, False) for s in strides][rank % model_size]
        return model_group, data_group
    # Only the members of a proper subgroup take part: each creates its own groups.
    _check_local_creation_is_consistent(parent_group, where)
    model_group = parent if model_size == size else _new_group(blocks[rank // model_size], True)
    data_group = parent if num_groups == size else _new_group(strides[rank % model_size], True)
    return model_group, data_group


def create_groups_from_world(group_count: int, include_init: Optional[str] = None,
                             parent_group: Optional[Any] = None) -> ParallelEnv:
    """Splits ``parent_group`` (default WORLD) into model groups and data groups.

    Args:
        group_count: number of model groups (the data-parallel degree); a
            negative value -S asks for model groups of S ranks.  Must divide
            the size of the parent group.
        include_init: a backend ('nccl', 'gloo', 'mpi') to join the default
            process group with first (see the module docstring for the
            rendezvous); None uses the existing state.
        parent_group: the group to split (default WORLD).  A proper subgroup is
            split by its members only (every member must call this function);
            the returned ``global_*`` fields then describe the parent group.

    Returns:
        a ParallelEnv; results are cached per (parent group, group count).
    """
    global _process_backend
    where = "tutel.net.create_groups_from_world"
    if include_init is not None:
        if not _is_world(parent_group):
            raise ValueError(f"{where}: include_init={include_init!r} initialises the default group; it cannot be "
                             f"combined with a parent_group")
        backend = resolve_backend(include_init)
        if _process_backend is not None and backend != _process_backend:
            raise ValueError(f"{where}: backend {backend!r} was requested but this process already uses "
                             f"{_process_backend!r}; allowed: one backend per process")
        if is_distributed() and backend not in str(dist.get_backend()):
            raise ValueError(f"{where}: backend {backend!r} was requested but the default process group uses "
                             f"{dist.get_backend()!r}; allowed: one backend per process")
        initialize_process_group(backend)
        _process_backend = backend
    distributed = is_distributed()
    if distributed:
        _require_member(parent_group, where)
    parent_key = None if _is_world(parent_group) else parent_group
    size, rank = get_world_size(parent_group), get_world_rank(parent_group)
    num_groups = _resolve_group_count(group_count, size, where)
    key = (parent_key, num_groups, distributed)  # a layout made before the rendezvous is not reused after it
    cached = _layout_cache.get(key)
    if cached is not None:
        return cached
    if distributed:
        model_group, data_group = _split_groups(parent_key, num_groups, where)
        global_group = dist.group.WORLD if parent_key is None else parent_key
    else:
        model_group = data_group = global_group = None
    layout = ParallelEnv(size, rank, num_groups, _local_device(_process_backend, distributed),
                         data_group, model_group, global_group, distributed)
    _layout_cache[key] = layout
    return layout


def create_standalone_group() -> Optional[Any]:
    """A process group holding only this process (None when not distributed or on failure)."""
    if not is_distributed():
        return None
    timeout = global_timeout()
    try:
        return dist.new_group(ranks=[dist.get_rank()], timeout=timeout, use_local_synchronization=True)
    except (RuntimeError, ValueError) as error:
        logger.warning("create_standalone_group: %s", error)
        return None
