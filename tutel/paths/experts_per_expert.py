"""Experts stage for eager CUDA calls of float16 / float32 / float64 routed experts: the group ends
read on the host once, then one cuBLAS product per expert with rows (tutel.ops.per_expert_mm) in
place of the grouped products (PyTorch's grouped_mm has no kernel for these dtypes, tutel's grouped
kernel runs on CUDA cores).  The chooser sends here only calls that may synchronise: not under
CUDA-graph capture or torch.compile, which keep the grouped products (tutel.rules.paths)."""
from typing import List

from ..ops.per_expert_mm import per_expert_mm
from .work import Work


def group_ends_on_host(plan) -> List[int]:
    """The plan's group ends as ints: one device-to-host read, the call's one synchronisation."""
    return plan.offsets.tolist()


def products_per_expert(work: Work) -> None:
    """The experts (tutel.paths.work.WeightExperts) over the prepared grouped rows, each product one
    matrix product per expert."""
    ends = group_ends_on_host(work.plan)

    def product(rows, weight, offsets, transposed, bias=None, zero_tail=True):
        return per_expert_mm(rows, weight, ends, transposed, bias, zero_tail=zero_tail, offsets=offsets)

    work.out = work.experts(work.rows, work.plan, product)
    work.features = (work.out.shape[-1],)
