"""The public communication API: ``from tutel import net``.

Process groups: ``get_world_size``, ``get_world_rank``, ``create_groups_from_world``,
``create_standalone_group``, ``barrier``.

Without autograd: ``simple_all_reduce``, ``simple_all_to_all``, ``simple_split``,
``simple_reduce_scatter``, ``simple_all_gather``.

With autograd: ``all_to_all``, ``all_to_all_single``, ``all_gather``, ``zero_gather``,
``zero_scatter``, ``spatial_split``, ``reduce_scatter``, ``allreduce_forward``,
``allreduce_backward``.

Variable sizes: ``batch_all_to_all_v``, ``batch_all_gather_v``.

Optimizer: ``TutelDistributedOptimizer`` (ZeRO-1 style).

Every function takes ``group`` (default WORLD, or any process group) and works on
gloo (CPU) and NCCL (CUDA).  See tutel.collectives for the modules behind them.
"""
from .collectives import *  # noqa: F401,F403  (the names listed above, and a few helpers)
from .collectives import __all__  # noqa: F401
