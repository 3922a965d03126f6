"""The linear top-k gate (Tutel's ``{'type': 'top'}``)."""
import torch

from ..ops.linear import token_linear
from ._fp32 import Float32ParametersMixin
from ._options import check_routing_options, clamp_top_k


class LinearTopKGate(Float32ParametersMixin, torch.nn.Module):
    """logits = x @ wg^T (+ wg.bias with ``router_bias``) with one linear layer ``wg`` [E, model_dim].

    Args:
        model_dim: token feature size.
        num_global_experts: E.
        k: experts per token (reduced to E when larger).
        fp32_gate: keep ``wg`` and the logits in float32 whatever the model dtype.
        router_bias: give ``wg`` a bias [E] (gpt-oss's router has one).
        **options: ``capacity_factor`` and ``gate_noise`` (stored by the MoE layer).
    """

    def __init__(self, model_dim: int, num_global_experts: int, k: int = 1, fp32_gate: bool = False,
                 router_bias: bool = False, **options):
        super().__init__()
        check_routing_options(options, "top")
        self.fp32_gate = bool(fp32_gate)
        self.wg = torch.nn.Linear(model_dim, num_global_experts, bias=bool(router_bias),
                                  dtype=torch.float32 if self.fp32_gate else None)
        self.top_k = clamp_top_k(k, num_global_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.wg.weight
        # (.to costs a dispatch even where the dtypes agree)
        return token_linear(x if x.dtype == weight.dtype else x.to(weight.dtype), weight, self.wg.bias)


Gate = LinearTopKGate
