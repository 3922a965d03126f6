"""Experts stage for inference at decoding sizes on CUDA: tutel's decode_experts kernels read each
chosen expert's matrices once for all the tokens that chose it, with the gated unit and the
weighted combine fused (two launches, no host synchronisation)."""
from ..ops.decode_experts import decode_experts_planned
from .work import Work


def decode_kernel(work: Work) -> None:
    """decode_experts on the [T, k] choices: the combined [T, O] result."""
    g = work.experts.gated(work.dtype)
    work.y = decode_experts_planned(work.x, work.expert_ids, work.weights, g.up_weight, g.down_weight, g.up_bias,
                                    g.down_bias, g.transposed, g.unit, g.gate_weight)
    work.features = (work.y.shape[1],)
