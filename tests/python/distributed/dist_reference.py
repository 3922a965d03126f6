"""Single-process float64 definitions of the collectives, on the list of every rank's tensor.

Each function takes ``xs`` (index = rank) and returns the list of every rank's
output; the ranks of a launch compute these locally from the inputs of all ranks
(regenerated from the same seeds) and compare with the distributed result.
"""
import zlib
from typing import List, Sequence

import torch


def seeded(tag: str, rank: int, shape: Sequence[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normal random values, the same on every process for the same (tag, rank)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))
    return torch.randn(list(shape), generator=generator, dtype=torch.float64).to(dtype)


def seeded_ints(tag: str, rank: int, low: int, high: int, count: int) -> List[int]:
    """Uniform integers in [low, high), the same on every process for the same (tag, rank)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))
    return torch.randint(low, high, [count], generator=generator).tolist()


def all_to_all(xs: List[torch.Tensor], input_dim: int, output_dim: int) -> List[torch.Tensor]:
    """Rank r receives piece r of every rank's output_dim, concatenated along input_dim in rank order."""
    world = len(xs)
    return [torch.cat([x.chunk(world, dim=output_dim)[rank] for x in xs], dim=input_dim) for rank in range(world)]


def all_gather(xs: List[torch.Tensor], dim: int) -> List[torch.Tensor]:
    return [torch.cat(xs, dim=dim) for _ in xs]


def split(x: torch.Tensor, dim: int, world: int) -> List[torch.Tensor]:
    return list(x.chunk(world, dim=dim))


def reduce_scatter(xs: List[torch.Tensor], dim: int) -> List[torch.Tensor]:
    return split(sum(xs), dim, len(xs))


def reduce(xs: List[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(xs)
    if op == "SUM":
        return stacked.sum(0)
    if op == "PRODUCT":
        return stacked.prod(0)
    if op == "MIN":
        return stacked.amin(0)
    if op == "MAX":
        return stacked.amax(0)
    if op == "AVG":
        return stacked.mean(0)
    raise ValueError(op)


def all_to_all_v(datas: List[torch.Tensor], partitions: List[List[int]]) -> List[torch.Tensor]:
    """Rank r receives, from every rank s in order, the r-th piece of s's flat data."""
    world = len(datas)
    pieces = [list(torch.split(data.reshape(-1), partition)) for data, partition in zip(datas, partitions)]
    return [torch.cat([pieces[source][rank] for source in range(world)]) for rank in range(world)]
