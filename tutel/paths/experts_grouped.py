"""Experts stage: the experts' grouped products over grouped rows (through autograd where it
records: tutel.ops.grouped_mm.grouped_rows_mm is one differentiable, traceable operator)."""
from .work import Work


def grouped_products(work: Work) -> None:
    """``products(rows, plan)`` of the experts (tutel.paths.work.WeightExperts, or a module's
    grouped_products) over the prepared rows."""
    products, _ = work.experts.grouped_products(work.dtype)
    work.out = products(work.rows, work.plan)
    work.features = (work.out.shape[-1],)
