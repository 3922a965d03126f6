"""Experts stage for CPU and CUDA inference of quantized experts at decoding sizes: tutel's
decode_quantized_experts operator reads each chosen expert's packed codes once for all the tokens
that chose it, decoding them as it reads, with the unit and the weighted combine fused (one
operator call, two kernels on CUDA; the routed choices as the caller gave them)."""
from .work import Work


def quantized_decode(work: Work) -> None:
    """The decode operator on the [T, k] choices (work.experts: tutel.paths.QuantizedExperts whose
    decode_form() is not None): the combined [T, O] result."""
    work.y = work.experts.decode(work.x, work.expert_ids, work.weights)
    work.features = (work.y.shape[1],)
