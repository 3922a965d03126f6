"""Collectives without autograd (Tutel's ``simple_*`` helpers), on any process group.

Conventions: tensors are split and gathered along dim 0 in group-rank order;
with one process every function returns its input (``simple_all_reduce``
returns a copy unless ``inplace``).  Every collective runs on gloo (CPU
tensors) and NCCL (CUDA tensors).  A failure of a peer (exit, crash, or not
reaching the collective within ``TUTEL_GLOBAL_TIMEOUT_SEC``) raises
``CollectiveError`` naming the collective.
"""
import contextlib
import functools
import inspect
import os
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..ops.checks import require_tensor
from .process_groups import TIMEOUT_ENV, get_world_rank, get_world_size, global_timeout

SKIP_A2A_ENV = "SKIP_A2A"

# Single-tensor all-gather / reduce-scatter under their current names (older PyTorch: the *_tensor names).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed: a peer exited or crashed, disagreed on the tensor sizes, or timed out."""


@contextlib.contextmanager
def collective_errors(where: str, group: Optional[Any]) -> Iterator[None]:
    """Re-raises a failed collective as CollectiveError with the group size and the timeout."""
    size = get_world_size(group)
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        raise CollectiveError(
            f"{where}: the collective over a group of {size} processes failed (a peer process exited or crashed, "
            f"passed tensors of other sizes, or did not reach this collective within "
            f"{TIMEOUT_ENV}={global_timeout().total_seconds():g} s): {error}") from error


def waiter(work: Any, where: str, group: Optional[Any]) -> Callable[..., None]:
    """A function that waits for an asynchronous collective (with CollectiveError on failure)."""
    def wait(*unused: Any) -> None:
        with collective_errors(where, group):
            work.wait()
    return wait


def _no_wait(*unused: Any) -> None:
    return None


def require_divisible_dim0(input: torch.Tensor, world_size: int, where: str) -> None:
    """Raises ValueError unless ``input`` has a dim 0 divisible by ``world_size``."""
    require_tensor(input, "input", where, min_dim=1)
    if input.size(0) % world_size != 0:
        raise ValueError(f"{where}: dim 0 of `input` (shape {tuple(input.shape)}) has length {input.size(0)}, "
                         f"which is not divisible by the group size {world_size}")


def reduce_op(op: Any, where: str) -> Any:
    """Validates a torch.distributed.ReduceOp (None means SUM)."""
    if op is None:
        return dist.ReduceOp.SUM
    if not isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        raise TypeError(f"{where}: `op` must be a torch.distributed.ReduceOp (SUM, PRODUCT, MIN, MAX, AVG, BAND, "
                        f"BOR, BXOR), got {op!r}")
    return op


def skip_all_to_all() -> bool:
    """True when env SKIP_A2A > 0: all-to-all becomes the identity (for profiling the rest)."""
    raw = os.environ.get(SKIP_A2A_ENV, "0").strip() or "0"
    try:
        return int(raw) > 0
    except ValueError:
        raise ValueError(f"{SKIP_A2A_ENV}={raw!r} is not valid; allowed: an integer (> 0 skips all-to-all)") from None


def _reduced_by_gloo(tensor: torch.Tensor, group: Optional[Any]) -> bool:
    """Whether ``group`` reduces ``tensor`` through gloo (a gloo group, or a CPU tensor of a group
    whose backend is given per device, "cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend(group))
    return backend == "gloo" or (tensor.device.type == "cpu" and "cpu:gloo" in backend)


def simple_all_reduce(input: torch.Tensor, group: Optional[Any] = None, op: Any = None,
                      inplace: bool = False) -> torch.Tensor:
    """All-reduce with ``op`` (default SUM) over ``group``; returns a new tensor unless ``inplace``."""
    where = "tutel.net.simple_all_reduce"
    require_tensor(input, "input", where)
    op = reduce_op(op, where)
    if inplace and input.is_contiguous():
        output = input
    else:
        output = torch.clone(input, memory_format=torch.contiguous_format)
    world_size = get_world_size(group)
    # gloo refuses AVG before PyTorch 2.8: there it is the sum, divided here, on every release alike
    average_by_hand = world_size > 1 and op == dist.ReduceOp.AVG and _reduced_by_gloo(output, group)
    if average_by_hand and not output.is_floating_point():
        raise ValueError(f"{where}: op=AVG needs a floating-point tensor, got {output.dtype}")
    if world_size > 1:
        with collective_errors(where, group):
            dist.all_reduce(output, op=dist.ReduceOp.SUM if average_by_hand else op, group=group)
        if average_by_hand:
            output.div_(world_size)
    if inplace and output is not input:
        input.copy_(output)
        return input
    return output


def simple_all_to_all(input: torch.Tensor, group: Optional[Any] = None, background: bool = False
                      ) -> Union[torch.Tensor, Tuple[torch.Tensor, Callable[..., None]]]:
    """All-to-all of equal chunks along dim 0: chunk i goes to rank i, received chunks in rank order.

    With ``background=True`` returns ``(output, wait_fn)``: the collective runs
    asynchronously and ``output`` is valid once ``wait_fn()`` returned.
    Bypassed (identity) when env ``SKIP_A2A`` > 0.
    """
    where = "tutel.net.simple_all_to_all"
    world_size = get_world_size(group)
    require_divisible_dim0(input, world_size, where)
    input = input.contiguous()
    if world_size == 1 or skip_all_to_all():
        return (input, _no_wait) if background else input
    output = torch.empty_like(input)
    with collective_errors(where, group):
        work = dist.all_to_all_single(output, input, group=group, async_op=background)
    if background:
        return output, waiter(work, where, group)
    return output


def simple_split(input: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """This rank's equal chunk of ``input`` along dim 0 (no communication)."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input
    require_divisible_dim0(input, world_size, "tutel.net.simple_split")
    chunk = input.size(0) // world_size
    return input.contiguous().narrow(0, get_world_rank(group) * chunk, chunk)


def _reduce_received(stacked: torch.Tensor, op: Any, where: str) -> torch.Tensor:
    """Reduces the [W, ...] chunks received from every rank with ``op`` (rank order)."""
    ReduceOp = dist.ReduceOp
    if op == ReduceOp.SUM:
        return stacked.sum(dim=0, dtype=stacked.dtype) if stacked.dtype != torch.bool else stacked.any(dim=0)
    if op == ReduceOp.PRODUCT:
        return stacked.prod(dim=0, dtype=stacked.dtype) if stacked.dtype != torch.bool else stacked.all(dim=0)
    if op == ReduceOp.MIN:
        return stacked.amin(dim=0)
    if op == ReduceOp.MAX:
        return stacked.amax(dim=0)
    if op == ReduceOp.AVG:
        if not stacked.is_floating_point():
            raise ValueError(f"{where}: op=AVG needs a floating-point tensor, got {stacked.dtype}")
        return stacked.mean(dim=0)
    bitwise = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}
    for candidate, function in bitwise.items():
        if op == candidate:
            return functools.reduce(function, stacked.unbind(0))
    raise ValueError(f"{where}: op={op!r} is not supported; allowed: SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR")


def simple_reduce_scatter(input: torch.Tensor, group: Optional[Any] = None, op: Any = None) -> torch.Tensor:
    """Reduces ``input`` over ``group`` with ``op`` (default SUM) and returns this rank's chunk of dim 0.

    CUDA tensors use the backend's reduce-scatter; CPU tensors (gloo has no
    portable reduce-scatter) use an all-to-all of the chunks followed by a
    local reduction in rank order, which moves the same bytes.
    """
    where = "tutel.net.simple_reduce_scatter"
    op = reduce_op(op, where)
    world_size = get_world_size(group)
    if world_size == 1:
        return input
    require_divisible_dim0(input, world_size, where)
    input = input.contiguous()
    if input.is_cuda:
        output = torch.empty((input.size(0) // world_size,) + tuple(input.shape[1:]),
                             dtype=input.dtype, device=input.device)
        with collective_errors(where, group):
            reduce_scatter_single(output, input, op=op, group=group)
        return output
    received = torch.empty_like(input)
    with collective_errors(where, group):
        dist.all_to_all_single(received, input, group=group)
    return _reduce_received(received.view((world_size, -1) + tuple(input.shape[1:])), op, where)


def simple_all_gather(input: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """Concatenation along dim 0 of every rank's ``input`` (equal shapes), in rank order."""
    where = "tutel.net.simple_all_gather"
    require_tensor(input, "input", where)
    world_size = get_world_size(group)
    if world_size == 1:
        return input
    input = input.contiguous()
    output = torch.empty([world_size * input.numel()], dtype=input.dtype, device=input.device)
    with collective_errors(where, group):
        all_gather_single(output, input.reshape(-1), group=group)
    return output.view([-1] + list(input.shape[1:]))


# Process groups over the same processes as a group without a CPU backend (NCCL only), for the
# collectives of host integers; made at the first such collective and kept.
_CPU_GROUPS: Dict[Any, Any] = {}


def _takes_cpu_tensors(group: Optional[Any]) -> bool:
    """Whether `group`'s backend runs collectives on CPU tensors (gloo, MPI, PyTorch's default
    "cpu:gloo,cuda:nccl" pair), not only on device tensors (NCCL)."""
    if hasattr(dist, "get_backend_config"):
        return "cpu:" in dist.get_backend_config(group)
    return dist.get_backend(group) in ("gloo", "mpi")


def _cpu_group(group: Optional[Any]) -> Optional[Any]:
    """A group taking CPU tensors over `group`'s processes: the group itself, or a gloo group over
    its ranks, made by those processes alone (PyTorch's use_local_synchronization); None where
    this PyTorch cannot make one without every process of the world taking part, or making it
    failed (a warning)."""
    if _takes_cpu_tensors(group):
        return group
    key = group if group is not None else dist.group.WORLD
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = None
        if "use_local_synchronization" in inspect.signature(dist.new_group).parameters:
            try:
                _CPU_GROUPS[key] = dist.new_group(dist.get_process_group_ranks(key), backend="gloo",
                                                  timeout=global_timeout(), use_local_synchronization=True)
            except RuntimeError as error:  # e.g. gloo cannot connect: the device path still works
                warnings.warn(f"tutel: no gloo group for the host integers of a process group ({error}); they go "
                              "through the device, which waits for its queued kernels", RuntimeWarning, stacklevel=3)
    return _CPU_GROUPS[key]


def all_reduce_max_ints(values: Sequence[int], group: Optional[Any] = None,
                        device: Optional[torch.device] = None) -> List[int]:
    """Each host integer's maximum over ``group``, with no device synchronisation: the integers
    travel as a CPU tensor through a backend that takes one (the group's own, else a gloo group
    over its processes, made once), so nothing waits for the kernels queued on a device and CUDA
    graphs can capture the calls around it.  Only where no CPU group can be had (a PyTorch
    without use_local_synchronization, a gloo group that could not be made) do they go through
    ``device`` and are read back."""
    values = [int(v) for v in values]
    if get_world_size(group) == 1:
        return values
    cpu_group = _cpu_group(group)
    on = torch.device("cpu") if cpu_group is not None else device
    tensor = torch.tensor(values, dtype=torch.int64, device=on)
    with collective_errors("tutel all_reduce_max_int", group):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=cpu_group if cpu_group is not None else group)
    return tensor.tolist()


def all_reduce_max_int(value: int, device: torch.device, group: Optional[Any] = None) -> int:
    """The maximum of a host integer over ``group``: one small collective when distributed, on a
    CPU tensor (the group's CPU backend, or a gloo group over its processes), so it waits for no
    device; ``device`` carries it only where no such group can be made."""
    return all_reduce_max_ints([value], group, device)[0]

