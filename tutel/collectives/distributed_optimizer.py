"""TutelDistributedOptimizer: ZeRO-1 style sharding of the optimizer over the shared parameters.

Shared (non-expert) parameters are replicated on every rank of ``group``; each
rank keeps the optimizer state of only 1/W of every such parameter (its shard:
the flattened parameter, zero-padded to a multiple of W, cut into W equal
pieces).  Expert parameters (attribute ``_tutel_expert`` or
``skip_allreduce``) belong to their rank alone: they are optimised locally with
their local gradients.

``step()``: one reduce-scatter of all shared gradients (summed over the ranks,
divided by W when ``average_shared``), the local optimizer's step on the shards
and the expert parameters, then one all-gather that writes the updated shards
back into every replica.  Parameters are grouped into one flat buffer per
(device, dtype), so a step issues two collectives per buffer whatever the
number of parameters.

For elementwise optimizers (SGD, Adam, AdamW, RMSprop, ...) the result equals
the plain optimizer on the full parameters with the reduced gradients.  A
parameter without a gradient on a rank contributes zeros; a parameter without a
gradient on every rank is skipped by the local optimizer, as torch does.
"""
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .process_groups import get_world_rank, get_world_size
from .simple_collectives import simple_all_gather, simple_reduce_scatter


def is_expert_param(param: torch.Tensor) -> bool:
    """True for parameters owned by one rank (marked ``_tutel_expert`` or ``skip_allreduce``)."""
    return hasattr(param, "_tutel_expert") or bool(getattr(param, "skip_allreduce", False))


class _ShardedBuffer:
    """The shared parameters of one (device, dtype), each sharded W ways.

    Communication layout: a [W, S + P] buffer whose row r holds, for every
    parameter i, its r-th shard (``shard_sizes[i]`` elements, at ``offsets[i]``),
    followed by P = len(params) "has a gradient" flags.
    """

    def __init__(self, params: List[torch.Tensor], group: Optional[Any]):
        self.params = params
        self.group = group
        self.world_size = get_world_size(group)
        self.shard_sizes = [-(-param.numel() // self.world_size) for param in params]
        self.offsets = [sum(self.shard_sizes[:index]) for index in range(len(params))]
        self.total = sum(self.shard_sizes)
        self.shards = [torch.zeros([size], dtype=param.dtype, device=param.device)
                       for param, size in zip(params, self.shard_sizes)]
        self.load_shards_from_params()

    def _rows(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """A flat tensor of parameter ``index`` as [W, shard size] (zero-padded)."""
        size = self.shard_sizes[index]
        padding = size * self.world_size - flat.numel()
        if padding:
            flat = torch.cat([flat, flat.new_zeros([padding])])
        return flat.view(self.world_size, size)

    @torch.no_grad()
    def load_shards_from_params(self) -> None:
        """Copies this rank's slice of every parameter into its shard (parameters may have been reassigned)."""
        rank = get_world_rank(self.group)
        for index, (param, shard) in enumerate(zip(self.params, self.shards)):
            shard.copy_(self._rows(param.detach().reshape(-1), index)[rank])

    @torch.no_grad()
    def reduce_scatter_grads(self, average: bool) -> None:
        """Sets each shard's gradient to its slice of the gradient summed over the ranks (None if no rank has one)."""
        first = self.params[0]
        send = torch.zeros([self.world_size, self.total + len(self.params)], dtype=first.dtype, device=first.device)
        for index, param in enumerate(self.params):
            if param.grad is not None:
                start = self.offsets[index]
                send[:, start:start + self.shard_sizes[index]] = self._rows(param.grad.reshape(-1), index)
                send[:, self.total + index] = 1
        reduced = simple_reduce_scatter(send, self.group).reshape(-1)
        if average:
            reduced[:self.total] /= self.world_size
        has_grad = reduced[self.total:].tolist()
        for index, shard in enumerate(self.shards):
            start = self.offsets[index]
            shard.grad = reduced[start:start + self.shard_sizes[index]].clone() if has_grad[index] else None

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Writes the updated shards of every rank back into the full parameters."""
        gathered = simple_all_gather(torch.cat(self.shards), self.group).view(self.world_size, self.total)
        for index, param in enumerate(self.params):
            start = self.offsets[index]
            full = gathered[:, start:start + self.shard_sizes[index]].reshape(-1)[:param.numel()]
            param.copy_(full.view_as(param))


class TutelDistributedOptimizer:
    """ZeRO-1 style optimizer wrapper (see the module docstring).

    Usage::

        optimizer = TutelDistributedOptimizer(model.parameters(), group=None, average_shared=True)
        optimizer = optimizer.warp_local(torch.optim.Adam, lr=1e-3)
        loss.backward(); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, params: Iterable[torch.Tensor], group: Optional[Any] = None, average_shared: bool = False):
        params = list(params)
        for index, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"TutelDistributedOptimizer: `params` must be an iterable of tensors (parameter "
                                f"groups are not supported); item {index} is {type(param).__name__}")
        self.params = [param for param in params if not is_expert_param(param)]
        self.expert_params = [param for param in params if is_expert_param(param)]
        self.shapes = [param.shape for param in self.params]
        self.group = group
        self.average_shared = bool(average_shared)
        self.local_optim: Optional[torch.optim.Optimizer] = None
        self._buffers: List[_ShardedBuffer] = []

    def warp_local(self, local_optim: Callable[..., torch.optim.Optimizer], *args: Any,
                   **kwargs: Any) -> "TutelDistributedOptimizer":
        """Builds ``local_optim(shards + expert params, *args, **kwargs)`` and returns self."""
        by_kind: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        for param in self.params:
            by_kind.setdefault((param.device, param.dtype), []).append(param)
        self._buffers = [_ShardedBuffer(params, self.group) for params in by_kind.values()]
        shards = [shard for buffer in self._buffers for shard in buffer.shards]
        self.local_optim = local_optim(shards + self.expert_params, *args, **kwargs)
        return self

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The local optimizer's parameter groups (e.g. to change the learning rate)."""
        return self._local().param_groups

    def _local(self) -> torch.optim.Optimizer:
        if self.local_optim is None:
            raise RuntimeError("TutelDistributedOptimizer: call warp_local(OptimizerClass, ...) before using it")
        return self.local_optim

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of the parameters and of the shards."""
        shards = [shard for buffer in self._buffers for shard in buffer.shards]
        for param in self.params + self.expert_params + shards:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.zero_()

    def step(self) -> None:
        """Reduce-scatters the shared gradients, steps locally and all-gathers the shared parameters."""
        optimizer = self._local()
        for buffer in self._buffers:
            buffer.load_shards_from_params()
            buffer.reduce_scatter_grads(self.average_shared)
        optimizer.step()
        for buffer in self._buffers:
            buffer.all_gather_params()
