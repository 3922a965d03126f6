"""The cosine top-k gate (Tutel's ``{'type': 'cosine_top'}``, as in Swin-MoE)."""
import math

import torch
import torch.nn.functional as F

from ._fp32 import Float32ParametersMixin
from ._options import check_routing_options, clamp_top_k


class CosineTopKGate(Float32ParametersMixin, torch.nn.Module):
    """logits = cos(proj(x), sim_matrix[:, e]) * exp(min(temperature, log 100)).

    Parameters: ``temperature`` [1] (initialised to log(1 / init_t)),
    ``cosine_projector`` (Linear(model_dim, proj_dim) with bias) and
    ``sim_matrix`` [proj_dim, E] (initialised N(0, 0.01)).
    """

    def __init__(self, model_dim: int, num_global_experts: int, k: int = 1, fp32_gate: bool = False,
                 proj_dim: int = 256, init_t: float = 0.5, **options):
        super().__init__()
        check_routing_options(options, "cosine_top")
        if not init_t > 0:
            raise ValueError(f"cosine_top gate: init_t must be > 0, got {init_t}")
        self.fp32_gate = bool(fp32_gate)
        self.top_k = clamp_top_k(k, num_global_experts)
        self.temperature = torch.nn.Parameter(torch.log(torch.full([1], 1.0 / init_t)))
        self.cosine_projector = torch.nn.Linear(model_dim, proj_dim)
        self.sim_matrix = torch.nn.Parameter(torch.empty(proj_dim, num_global_experts))
        torch.nn.init.normal_(self.sim_matrix, 0, 0.01)
        self.clamp_max = math.log(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.sim_matrix.dtype
        projected = self.cosine_projector(x.to(dtype))
        logits = F.normalize(projected, dim=1) @ F.normalize(self.sim_matrix, dim=0)
        return logits * torch.exp(torch.clamp(self.temperature, max=self.clamp_max))


Gate = CosineTopKGate
