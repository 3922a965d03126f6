"""The collectives subsystem: process groups, collectives with and without autograd, the
expert exchange and the distributed optimizer, in one namespace.

``tutel.net`` (the public API) and ``tutel.impls.communicate`` (Tutel's module path)
re-export it.  The implementations live in small modules of this package:

* process_groups: world queries, rendezvous, ``create_groups_from_world``;
* simple_collectives: the ``simple_*`` collectives (no autograd);
* exchange: the flat and 2D-hierarchical all-to-all exchange;
* autograd_collectives: ``all_to_all``, ``all_gather``, ``zero_gather`` ...;
* variable_collectives: ``batch_all_to_all_v``, ``batch_all_gather_v``;
* distributed_optimizer: ``TutelDistributedOptimizer``.

Every function works without torch.distributed being initialised (a world of
one process).
"""
from .autograd_collectives import (
    all_gather,
    all_to_all,
    all_to_all_single,
    allreduce_backward,
    allreduce_forward,
    reduce_scatter,
    spatial_split,
    zero_gather,
    zero_scatter,
)
from .distributed_optimizer import TutelDistributedOptimizer, is_expert_param
from .process_groups import (
    ParallelEnv,
    barrier,
    create_groups_from_world,
    create_standalone_group,
    get_world_rank,
    get_world_size,
    global_timeout,
    group_ranks,
    is_distributed,
)
from .simple_collectives import (
    CollectiveError,
    all_reduce_max_int,
    simple_all_gather,
    simple_all_reduce,
    simple_all_to_all,
    simple_reduce_scatter,
    simple_split,
)
from .variable_collectives import batch_all_gather_v, batch_all_to_all_v

__all__ = [
    "CollectiveError",
    "ParallelEnv",
    "TutelDistributedOptimizer",
    "all_gather",
    "all_reduce_max_int",
    "all_to_all",
    "all_to_all_single",
    "allreduce_backward",
    "allreduce_forward",
    "barrier",
    "batch_all_gather_v",
    "batch_all_to_all_v",
    "create_groups_from_world",
    "create_standalone_group",
    "get_world_rank",
    "get_world_size",
    "global_timeout",
    "group_ranks",
    "is_distributed",
    "is_expert_param",
    "reduce_scatter",
    "simple_all_gather",
    "simple_all_reduce",
    "simple_all_to_all",
    "simple_reduce_scatter",
    "simple_split",
    "spatial_split",
    "zero_gather",
    "zero_scatter",
]
