"""Running the experts of an MoE layer across a process group.

Parameters never change layout; the call's ``adaptive_r`` only changes how tokens and
weights move (Tutel's zero-cost parallelism switching):

* r = 0: no token exchange.  Each process runs every expert on its own tokens, with the
  expert weights gathered from all processes (ZeRO-3 style; gradients are reduce-scattered
  back to their owners).
* r >= 1, one process per expert or more experts than processes (S = 1): the standard
  expert-parallel all-to-all ``[E, C, M] -> [E/W, W*C, M]``, local experts, and back.
* r >= 1 with S > 1 processes sharing each expert (each holding a 1/S slice of the hidden
  dim): every expert's C tokens are replicated r times and spread over its S processes,
  weights are gathered over groups of S/r processes (each group then holds 1/r of the
  hidden dim), and the r partial outputs are summed after the exchange back.

``a2a_ffn_overlap_degree = o > 1`` splits the capacity dim into o chunks whose exchanges
run in the background while the experts work on earlier chunks; the result is the same.
"""
from typing import Callable, List

import torch

from ..collectives.autograd_collectives import all_to_all

LocalExperts = Callable[[torch.Tensor], torch.Tensor]  # [L, C', M] slots of the local experts -> [L, C', M']


def run_experts_distributed(layer, y: torch.Tensor, overlap: int, adaptive_r: int,
                            local_experts: LocalExperts) -> torch.Tensor:
    """[E, C, M] dispatched tokens of this process -> [E, C, M'] expert outputs for them, with
    `local_experts` running this process's experts on the slots it receives."""
    if adaptive_r == 0:
        return local_experts(y)
    world_size, num_experts = layer.world_size, layer.num_global_experts
    sharded = layer.sharded_count > 1
    if sharded:
        # [E, C, M] -> [E, r*C, M] -> [W, r*C/S, M]: process e*S+s gets part s of expert e's copies.
        y = y.repeat(1, adaptive_r, 1).view(world_size, -1, y.size(2))
    y = _exchange_and_compute(layer, y, overlap, local_experts)
    if sharded:
        y = y.view(num_experts, adaptive_r, -1, y.size(2)).sum(dim=1)
    return y


def _exchange_and_compute(layer, y: torch.Tensor, overlap: int, local_experts: LocalExperts) -> torch.Tensor:
    """all_to_all(y, 1, 0) -> local experts -> all_to_all(., 0, 1), pipelined over `overlap` chunks."""
    group, use_2dh = layer.group, layer.use_2dh
    if overlap <= 1:
        y = all_to_all(y, 1, 0, group=group, use_2dh=use_2dh)
        y = local_experts(y)
        return all_to_all(y, 0, 1, group=group, use_2dh=use_2dh)
    chunks = y.chunk(overlap, dim=1)
    # Start every chunk's exchange; each chunk's experts run while later chunks are in flight,
    # and each result travels back in the background while the next chunk computes.
    arrivals = [all_to_all(chunk, 1, 0, group=group, use_2dh=use_2dh, background=True) for chunk in chunks]
    departures: List = []
    for arrival in arrivals:
        computed = local_experts(arrival())
        departures.append(all_to_all(computed, 0, 1, group=group, use_2dh=use_2dh, background=True))
    return torch.cat([departure() for departure in departures], dim=1)
