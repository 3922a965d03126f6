"""The all-to-all exchange behind ``tutel.net.all_to_all``: flat or 2D-hierarchical (2DH).

An exchange takes a send buffer ``[W, ...]`` whose row ``d`` goes to group rank
``d`` and returns the receive buffer ``[W, ...]`` whose row ``s`` came from
group rank ``s`` -- exactly ``all_to_all_single``.  Both algorithms produce the
same result; they differ in the messages they send.

2DH: the W ranks of the group form N "nodes" of L consecutive group ranks.  Step
1 exchanges, inside each node, the rows bound for every node (one message of N
rows per local peer); step 2 exchanges, between ranks with the same local index
on different nodes, the rows gathered in step 1 (one message of L rows per
node).  Inter-node traffic thus travels as N-1 large messages instead of W-L
small ones, which pays off at large scale.

L comes from the physical layout: a process of global rank g runs on host
``g // LOCAL_SIZE`` (``LOCAL_SIZE`` from the mpiexec launcher, or torchrun's
``LOCAL_WORLD_SIZE``), so the hierarchy follows the hosts of the group's
members.  When the members are not spread evenly and host-contiguously over
hosts, or lie on one host, or one per host, 2DH falls back to the flat exchange.
"""
import logging
from typing import Any, Callable, Dict, NamedTuple, Optional

import torch

from .process_groups import create_groups_from_world, group_ranks, local_size_from_env, register_group_cache
from .simple_collectives import simple_all_to_all

logger = logging.getLogger("tutel")


class Hierarchy(NamedTuple):
    """The 2DH factorisation of a group: ``nodes`` x ``local_size`` ranks."""

    local_group: Any   # the local_size ranks of this node (consecutive group ranks)
    cross_group: Any   # the ranks with this local index on every node (strided)
    local_size: int
    nodes: int


_hierarchies: Dict[Any, Optional[Hierarchy]] = register_group_cache({})
_warned_no_local_size = False


def members_per_host(ranks: list, local_size: int) -> Optional[int]:
    """Members of each host when they are evenly spread and host-contiguous in rank order, else None."""
    hosts = [rank // local_size for rank in ranks]
    runs = []
    for index, host in enumerate(hosts):
        if index == 0 or host != hosts[index - 1]:
            runs.append([host, 0])
        runs[-1][1] += 1
    counts = {count for _, count in runs}
    distinct_hosts = len({host for host, _ in runs}) == len(runs)
    return counts.pop() if len(counts) == 1 and distinct_hosts else None


def hierarchy_of(group: Optional[Any]) -> Optional[Hierarchy]:
    """The 2DH hierarchy of ``group`` (None: use the flat exchange).  Cached per group."""
    global _warned_no_local_size
    key = group
    if key in _hierarchies:
        return _hierarchies[key]
    local_size = local_size_from_env()
    if local_size is None:
        if not _warned_no_local_size:
            logger.warning("use_2dh: neither LOCAL_SIZE nor LOCAL_WORLD_SIZE is set, so the processes per host are "
                           "unknown and the 2D-hierarchical all-to-all runs as a flat all-to-all")
            _warned_no_local_size = True
        local_size = 1
    ranks = group_ranks(group)
    per_host = members_per_host(ranks, local_size)
    hierarchy = None
    if per_host is not None and 1 < per_host < len(ranks):
        layout = create_groups_from_world(-per_host, parent_group=group)
        hierarchy = Hierarchy(layout.model_group, layout.data_group, per_host, len(ranks) // per_host)
    elif per_host is None:
        logger.info("use_2dh: the group's members are not spread evenly over hosts; using the flat all-to-all")
    _hierarchies[key] = hierarchy
    return hierarchy


class PendingExchange:
    """An exchange in flight; ``wait()`` returns the receive buffer ``[W, ...]`` (once)."""

    def __init__(self, received: torch.Tensor, wait: Callable[[], None],
                 finish: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self._received = received
        self._wait = wait
        self._finish = finish
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._wait()
            self._result = self._received if self._finish is None else self._finish(self._received)
            self._received = None
        return self._result


def start_exchange(send: torch.Tensor, group: Optional[Any], use_2dh: bool) -> PendingExchange:
    """Starts the exchange of ``send`` ([W, ...], row d for group rank d) asynchronously.

    With 2DH the intra-node step runs in the background and the inter-node step
    when ``wait()`` is called.
    """
    hierarchy = hierarchy_of(group) if use_2dh else None
    if hierarchy is None:
        received, wait = simple_all_to_all(send, group, background=True)
        return PendingExchange(received, wait)
    rows = tuple(send.shape[1:])
    local_size, nodes = hierarchy.local_size, hierarchy.nodes
    # [dst node, dst local, ...] -> [dst local, dst node, ...]: one block of N rows per local peer.
    by_local_peer = send.view((nodes, local_size) + rows).transpose(0, 1).contiguous()
    received, wait = simple_all_to_all(by_local_peer, hierarchy.local_group, background=True)

    def inter_node(from_local_peers: torch.Tensor) -> torch.Tensor:
        # [src local, dst node, ...] -> [dst node, src local, ...]: one block of L rows per node.
        by_node = from_local_peers.transpose(0, 1).contiguous()
        return simple_all_to_all(by_node, hierarchy.cross_group).view((nodes * local_size,) + rows)

    return PendingExchange(received, wait, inter_node)
