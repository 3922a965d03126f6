"""Experts stages of moe_layer's own experts module (tutel.paths.work.ModuleExperts): Tutel's slot
buffer through the module, the same across processes, and megablocks' occupied rows."""
import math

from .work import Work


def module_on_slots(work: Work) -> None:
    """The module on the [E, C, M] slot buffer (Tutel's padded path)."""
    out = work.experts.padded(work.rows)
    work.features = tuple(out.shape[2:])
    work.out = out.reshape(out.size(0), out.size(1), math.prod(work.features))


def module_across_processes(work: Work) -> None:
    """Each expert's slots travel to the process that holds it, through its module there, and back
    (tutel.paths.expert_parallel)."""
    from .expert_parallel import run_experts_distributed  # needs process groups: loaded on first use
    experts = work.experts
    ctx = experts.ctx
    features = []

    def local_experts(chunk):
        out = experts.padded(chunk)
        features[:] = out.shape[2:]
        return out.reshape(out.size(0), out.size(1), math.prod(out.shape[2:]))

    work.out = run_experts_distributed(experts.layer, work.rows, ctx.a2a_ffn_overlap_degree, ctx.adaptive_degree,
                                       local_experts)
    work.features = tuple(features or [work.out.shape[-1]])


def module_on_occupied_rows(work: Work) -> None:
    """The module's forward_grouped on the occupied rows (through autograd)."""
    _, _, group_rows = work.plan
    out = work.experts.grouped(work.rows, group_rows)
    work.features = tuple(out.shape[1:])
    work.out = out.reshape(1, out.shape[0], math.prod(work.features))
