"""Collectives with autograd (``tutel.net.all_to_all``, ``all_gather``, ``zero_gather`` ...).

Gradient conventions (each backward is the adjoint of its forward under the
stated convention; the tests check them against a single-process float64
computation):

* all_to_all / all_to_all_single / reduce_scatter / zero_gather /
  all_gather(fused=True): every rank holds its own input and its own loss; the
  gradient is that of the sum of the losses of all ranks.
* all_gather(fused=False), allreduce_forward: the output is replicated and
  every rank holds the same loss; each rank's input gets the gradient of that
  one loss (split / identity).
* spatial_split, allreduce_backward: the input is replicated (one logical
  tensor) and every rank holds its own loss; every rank gets the gradient of
  the sum of the losses (all-gather / all-reduce).

With one process every function returns its input (shapes unchanged).
"""
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

from ..ops.checks import require_tensor
from .exchange import start_exchange
from .process_groups import get_world_size
from .simple_collectives import (
    reduce_op,
    simple_all_gather,
    simple_all_reduce,
    simple_reduce_scatter,
    simple_split,
)


def _normalize_dim(dim: Any, ndim: int, name: str, where: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{where}: `{name}`={dim!r} is not a dimension of a {ndim}-D input; "
                         f"allowed: an integer in [{-ndim}, {ndim - 1}]")
    return dim % ndim


# ---------------------------------------------------------------------------
# all_to_all
# ---------------------------------------------------------------------------

def _send_buffer(input: torch.Tensor, output_dim: int, world_size: int) -> torch.Tensor:
    """[..., W*n (output_dim), ...] -> [W, ..., n, ...]: row d is the piece bound for rank d."""
    return input.unflatten(output_dim, (world_size, -1)).movedim(output_dim, 0).contiguous()


def _from_receive_buffer(received: torch.Tensor, input_dim: int) -> torch.Tensor:
    """[W, ...] -> the pieces of every source rank concatenated (rank-major) along input_dim."""
    return received.movedim(0, input_dim).flatten(input_dim, input_dim + 1)


def _all_to_all_now(input: torch.Tensor, input_dim: int, output_dim: int, group: Optional[Any],
                    use_2dh: bool) -> torch.Tensor:
    send = _send_buffer(input, output_dim, get_world_size(group))
    return _from_receive_buffer(start_exchange(send, group, use_2dh).wait(), input_dim)


class _AllToAll(torch.autograd.Function):
    """all_to_all whose backward is the inverse all_to_all (dims swapped)."""

    @staticmethod
    def forward(ctx, input, input_dim, output_dim, group, use_2dh):
        ctx.config = (input_dim, output_dim, group, use_2dh)
        return _all_to_all_now(input, input_dim, output_dim, group, use_2dh)

    @staticmethod
    def backward(ctx, grad_output):
        input_dim, output_dim, group, use_2dh = ctx.config
        return _AllToAll.apply(grad_output, output_dim, input_dim, group, use_2dh), None, None, None, None


class _FinishAllToAll(torch.autograd.Function):
    """Waits for a background all_to_all of ``input``; backward is the inverse all_to_all."""

    @staticmethod
    def forward(ctx, input, pending, input_dim, output_dim, group, use_2dh):
        ctx.config = (input_dim, output_dim, group, use_2dh)
        return _from_receive_buffer(pending.wait(), input_dim)

    @staticmethod
    def backward(ctx, grad_output):
        input_dim, output_dim, group, use_2dh = ctx.config
        return _AllToAll.apply(grad_output, output_dim, input_dim, group, use_2dh), None, None, None, None, None


def _start_background(input: torch.Tensor, input_dim: int, output_dim: int, group: Optional[Any],
                      use_2dh: bool) -> Callable[[], torch.Tensor]:
    with torch.no_grad():
        pending = start_exchange(_send_buffer(input.detach(), output_dim, get_world_size(group)), group, use_2dh)
    result: List[torch.Tensor] = []

    def finish() -> torch.Tensor:
        if not result:
            result.append(_FinishAllToAll.apply(input, pending, input_dim, output_dim, group, use_2dh))
        return result[0]

    return finish


def all_to_all(input: torch.Tensor, input_dim: int, output_dim: int, group: Optional[Any] = None,
               background: bool = False, use_2dh: bool = False) -> Union[torch.Tensor, Callable[[], torch.Tensor]]:
    """All-to-all with autograd: splits ``output_dim`` into W pieces, sends piece i to rank i,
    and concatenates the pieces received from ranks 0..W-1 along ``input_dim``.

    ``input_dim`` grows W times and ``output_dim`` shrinks W times; e.g. an
    ``[E, C, M]`` expert buffer becomes ``[E/W, W*C, M]`` with
    ``all_to_all(x, 1, 0)``.  With ``input_dim == output_dim`` the shape is kept
    (``all_to_all_single`` along that dim).  Backward is the inverse all-to-all.

    Args:
        background: start the exchange asynchronously and return a function
            that waits for it and returns the result (call it once the
            overlapping work is issued; calling it again returns the same tensor).
        use_2dh: the 2D-hierarchical algorithm (see tutel.collectives.exchange); its
            result equals the flat one.  Works on any ``group``.
    """
    where = "tutel.net.all_to_all"
    require_tensor(input, "input", where, min_dim=1)
    input_dim = _normalize_dim(input_dim, input.dim(), "input_dim", where)
    output_dim = _normalize_dim(output_dim, input.dim(), "output_dim", where)
    world_size = get_world_size(group)
    if input.size(output_dim) % world_size != 0:
        raise ValueError(f"{where}: dim {output_dim} (`output_dim`) of `input` (shape {tuple(input.shape)}) has "
                         f"length {input.size(output_dim)}, which is not divisible by the group size {world_size}")
    if world_size == 1:
        return (lambda: input) if background else input
    if background:
        return _start_background(input, input_dim, output_dim, group, bool(use_2dh))
    return _AllToAll.apply(input, input_dim, output_dim, group, bool(use_2dh))


def all_to_all_single(input: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """``torch.distributed.all_to_all_single`` (equal chunks of dim 0) with autograd."""
    return all_to_all(input, 0, 0, group=group)


# ---------------------------------------------------------------------------
# gather / split / reduce-scatter / all-reduce along a dimension
# ---------------------------------------------------------------------------

class _AllGather0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, fused, group):
        ctx.config = (fused, group)
        return simple_all_gather(input, group)

    @staticmethod
    def backward(ctx, grad_output):
        fused, group = ctx.config
        grad = simple_reduce_scatter(grad_output, group) if fused else simple_split(grad_output, group)
        return grad, None, None


class _ShardWithGatherBackward(torch.autograd.Function):
    """Forward: ``shard(input, group)`` (simple_split or simple_reduce_scatter); backward: all-gather."""

    @staticmethod
    def forward(ctx, input, shard, group):
        ctx.group = group
        return shard(input, group)

    @staticmethod
    def backward(ctx, grad_output):
        return simple_all_gather(grad_output, ctx.group), None, None


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, op, group):
        return simple_all_reduce(input, group=group, op=op)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, op, group):
        ctx.config = (op, group)
        return input

    @staticmethod
    def backward(ctx, grad_output):
        op, group = ctx.config
        return simple_all_reduce(grad_output, group=group, op=op), None, None


def _check_divisible(input: torch.Tensor, dim: int, group: Optional[Any], where: str) -> None:
    world_size = get_world_size(group)
    if input.size(dim) % world_size != 0:
        raise ValueError(f"{where}: dim {dim} (`dim`) of `input` (shape {tuple(input.shape)}) has length "
                         f"{input.size(dim)}, which is not divisible by the group size {world_size}")


def all_gather(input: torch.Tensor, dim: int, fused: bool = False, group: Optional[Any] = None) -> torch.Tensor:
    """Concatenates every rank's ``input`` along ``dim`` (rank order).

    Backward: this rank's slice of the gradient (``fused=False``: the output is
    replicated), or the sum over ranks of that slice (``fused=True``: a
    reduce-scatter, each rank having its own loss).
    """
    where = "tutel.net.all_gather"
    require_tensor(input, "input", where, min_dim=1)
    dim = _normalize_dim(dim, input.dim(), "dim", where)
    if get_world_size(group) == 1:
        return input
    return _AllGather0.apply(input.movedim(dim, 0), bool(fused), group).movedim(0, dim).contiguous()


def _shard_along(input: torch.Tensor, dim: int, group: Optional[Any], shard: Callable, where: str) -> torch.Tensor:
    require_tensor(input, "input", where, min_dim=1)
    dim = _normalize_dim(dim, input.dim(), "dim", where)
    if get_world_size(group) == 1:
        return input
    _check_divisible(input, dim, group, where)
    return _ShardWithGatherBackward.apply(input.movedim(dim, 0), shard, group).movedim(0, dim)


def spatial_split(input: torch.Tensor, dim: int, group: Optional[Any] = None) -> torch.Tensor:
    """This rank's equal slice of ``input`` along ``dim``; backward all-gathers the gradient."""
    return _shard_along(input, dim, group, simple_split, "tutel.net.spatial_split")


def reduce_scatter(input: torch.Tensor, dim: int, group: Optional[Any] = None) -> torch.Tensor:
    """Sums ``input`` over the ranks and keeps this rank's slice along ``dim``; backward all-gathers."""
    return _shard_along(input, dim, group, simple_reduce_scatter, "tutel.net.reduce_scatter").contiguous()


def _all_reduce_with(function: type, input: torch.Tensor, op: Any, group: Optional[Any], where: str) -> torch.Tensor:
    require_tensor(input, "input", where)
    op = reduce_op(op, where)
    if get_world_size(group) == 1:
        return input
    return function.apply(input, op, group)


def allreduce_forward(input: torch.Tensor, op: Any = None, group: Optional[Any] = None) -> torch.Tensor:
    """All-reduce with ``op`` (default SUM) in forward; identity in backward."""
    return _all_reduce_with(_AllReduceForward, input, op, group, "tutel.net.allreduce_forward")


def allreduce_backward(input: torch.Tensor, op: Any = None, group: Optional[Any] = None) -> torch.Tensor:
    """Identity in forward; all-reduce of the gradient with ``op`` (default SUM) in backward."""
    return _all_reduce_with(_AllReduceBackward, input, op, group, "tutel.net.allreduce_backward")


# ---------------------------------------------------------------------------
# ZeRO-style flat sharding
# ---------------------------------------------------------------------------

def zero_gather(input: torch.Tensor, full_shape: Optional[Sequence[int]] = None,
                group: Optional[Any] = None) -> torch.Tensor:
    """All-gathers the shards of a flat-sharded tensor and views them as ``full_shape``.

    The shards (one per rank, equal shapes) are concatenated along dim 0,
    flattened, truncated to ``prod(full_shape)`` elements (dropping the padding
    of ``zero_scatter``) and reshaped.  ``full_shape`` defaults to the
    concatenated shape.  Backward reduce-scatters the gradient to the shards.
    """
    where = "tutel.net.zero_gather"
    require_tensor(input, "input", where, min_dim=1)
    world_size = get_world_size(group)
    if not full_shape:
        full_shape = [input.size(0) * world_size] + list(input.shape[1:])
    full_shape = [int(size) for size in full_shape]
    numel = 1
    for size in full_shape:
        numel *= size
    available = input.numel() * world_size
    if any(size < 0 for size in full_shape) or numel > available:
        raise ValueError(f"{where}: `full_shape`={full_shape} needs {numel} elements but the {world_size} shard(s) "
                         f"of shape {tuple(input.shape)} hold {available}; allowed: non-negative sizes with at most "
                         f"{available} elements")
    gathered = input if world_size == 1 else _AllGather0.apply(input, True, group)
    return gathered.reshape(-1)[:numel].view(full_shape)


def zero_scatter(input: torch.Tensor, scatter_fn: Callable[..., torch.Tensor],
                 group: Optional[Any] = None) -> Tuple[torch.Tensor, torch.Size]:
    """Flattens ``input``, zero-pads it to a multiple of the group size and applies
    ``scatter_fn(flat, group=group)`` (e.g. simple_split or simple_reduce_scatter).

    Returns ``(scatter_fn's result, input.shape)``.
    """
    where = "tutel.net.zero_scatter"
    require_tensor(input, "input", where)
    if not callable(scatter_fn):
        raise TypeError(f"{where}: `scatter_fn` must be callable (e.g. tutel.net.simple_split), got {scatter_fn!r}")
    world_size = get_world_size(group)
    flat = input.reshape(-1)
    padding = (-flat.numel()) % world_size
    if padding:
        flat = torch.cat([flat, flat.new_zeros([padding])])
    return scatter_fn(flat, group=group), input.shape
