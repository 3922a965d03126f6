"""Which experts (or which slice of an expert) each process holds.

E global experts over W processes: with W <= E every process holds L = E / W whole
experts (process r: experts r*L .. r*L + L - 1); with W > E the S = W / E consecutive
processes r = e*S .. e*S + S - 1 share expert e, process r holding slice r % S of it.
The MoE layer derives its local expert count and shard count from this class, and the
checkpoint tools use it to map files to experts, so both sides follow one rule.

The layer's expert-count argument follows Tutel's convention, also handled here: n > 0
experts per process, or -n for n processes sharing one expert.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple


def valid_world_sizes(num_experts: int, limit: int = 64) -> List[int]:
    """World sizes (up to `limit`) that can hold `num_experts` experts: divisors and multiples of it."""
    return [w for w in range(1, limit + 1) if num_experts % w == 0 or w % num_experts == 0]


def local_expert_count(value) -> int:
    """Experts per process: n > 0 whole experts, -n: n processes share one expert.

    A float 1/n (Tutel's old ``count_per_node: 0.5`` syntax) means -n; -1 means 1."""
    if isinstance(value, bool):
        raise TypeError(f"num_experts_per_device must be an integer, got {value!r}")
    if isinstance(value, float):
        if value.is_integer():
            value = int(value)
        elif 0 < value < 1 and abs(1 / value - round(1 / value)) < 1e-6:
            value = -int(round(1 / value))
        else:
            raise ValueError(f"num_experts_per_device={value} is not allowed: use an integer n > 0 "
                             f"(experts per process) or -n (n processes share one expert)")
    if not isinstance(value, int):
        raise TypeError(f"num_experts_per_device must be an integer, got {type(value).__name__}")
    if value == 0:
        raise ValueError("num_experts_per_device=0 is not allowed: use n > 0 experts per process or -n "
                         "for n processes sharing one expert")
    return 1 if value == -1 else value


def global_expert_count(num_local_experts: int, world_size: int) -> int:
    """Total experts E over `world_size` processes holding `num_local_experts` each."""
    if num_local_experts > 0:
        return num_local_experts * world_size
    share = -num_local_experts
    if world_size % share != 0:
        raise ValueError(f"num_experts_per_device={num_local_experts} asks {share} processes to share each "
                         f"expert, but the group has {world_size} processes (must be a multiple of {share})")
    return world_size // share


def pop_local_expert_count(experts: Dict[str, Any]) -> int:
    """Removes and returns the per-process expert count (count_per_node wins over num_experts_per_device)."""
    if "count_per_node" in experts:
        experts.pop("num_experts_per_device", None)
        return local_expert_count(experts.pop("count_per_node"))
    return local_expert_count(experts.pop("num_experts_per_device", 1))


@dataclass(frozen=True)
class Placement:
    """The placement of ``num_experts`` experts on ``world_size`` processes."""

    num_experts: int
    world_size: int

    def __post_init__(self):
        e, w = self.num_experts, self.world_size
        if not isinstance(e, int) or e < 1:
            raise ValueError(f"num_global_experts must be a positive integer, got {e!r}")
        if not isinstance(w, int) or w < 1:
            raise ValueError(f"world size must be a positive integer, got {w!r}")
        if e % w != 0 and w % e != 0:
            raise ValueError(f"{e} experts cannot be placed on {w} processes: the world size must divide the "
                             f"expert count or be a multiple of it (e.g. {valid_world_sizes(e, 4 * e)})")

    @property
    def local_experts(self) -> int:
        """Experts per process (1 when experts are shared)."""
        return max(self.num_experts // self.world_size, 1)

    @property
    def sharded_count(self) -> int:
        """Processes sharing one expert (1 when every process holds whole experts)."""
        return max(self.world_size // self.num_experts, 1)

    def pieces(self, rank: int) -> List[Tuple[int, int]]:
        """(expert, slice) pairs held by `rank`, in storage order; slice is 0 for whole experts."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is out of range for a world of {self.world_size} processes")
        if self.sharded_count > 1:
            return [(rank // self.sharded_count, rank % self.sharded_count)]
        return [(rank * self.local_experts + i, 0) for i in range(self.local_experts)]

    def owners(self, expert: int) -> List[int]:
        """Ranks holding (a slice of) `expert`, in slice order."""
        if self.sharded_count > 1:
            return list(range(expert * self.sharded_count, (expert + 1) * self.sharded_count))
        return [expert // self.local_experts]

    def describe_rank(self, rank: int) -> str:
        """e.g. 'experts 2..3' or 'slice 1/2 of expert 0'."""
        pieces = self.pieces(rank)
        if self.sharded_count > 1:
            expert, piece = pieces[0]
            return f"slice {piece + 1}/{self.sharded_count} of expert {expert}"
        first, last = pieces[0][0], pieces[-1][0]
        return f"expert {first}" if first == last else f"experts {first}..{last}"
