"""SwiGLU experts with biases and clamping as in gpt-oss (``{'type': 'clamped_swiglu'}``).

For each expert e, with ``[g, u] = x W_gu[e] + b_gu[e]`` split into the gate and up halves:

    g' = min(g, limit),  u' = clamp(u, -limit, limit)
    y  = ((u' + 1) * g' * sigmoid(alpha * g')) W_down[e] + b_down[e]

(alpha = 1.702, limit = 7 in gpt-oss; ``limit=None`` clamps nothing).  With ``interleaved=True``
(gpt-oss's layout) the 2I columns of W_gu alternate gate, up, gate, up...; otherwise the first I
are the gate and the last I the up projection.
"""
import math
from typing import Optional

import torch

from ..ops.linear import linear_of_experts
from ..ops.gated_units import GatedUnit, gated_unit
from ._grouped import flatten_features, run_padded
from .sharding import _gather_over


class ClampedSwiGLUExperts(torch.nn.Module):
    """``num_experts_per_device`` clamped SwiGLU experts with biases.

    Parameters (transformers' gpt-oss layout, so weights can be shared with its models):
        gate_up_proj      [L, model_dim, 2 * hidden_size_per_expert]
        gate_up_proj_bias [L, 2 * hidden_size_per_expert]
        down_proj         [L, hidden_size_per_expert, model_dim]
        down_proj_bias    [L, model_dim]
    initialised like nn.Linear (uniform within 1 / sqrt(fan_in)).

    Args:
        alpha: the sigmoid's slope in g * sigmoid(alpha * g).
        limit: clamp bound (None: no clamping).
        interleaved: gate and up columns alternate (True) or are concatenated (False).
        has_bias: create the two biases (else registered as None).

    Each process holds whole experts: sharing one expert over processes (a negative
    num_experts_per_device) is not supported by this expert type.
    """

    def __init__(self, model_dim: int, hidden_size_per_expert: int, num_experts_per_device: int,
                 sharded_count: int = 1, alpha: float = 1.702, limit: Optional[float] = 7.0,
                 interleaved: bool = True, has_bias: bool = True):
        super().__init__()
        if sharded_count != 1:
            raise ValueError(f"experts type 'clamped_swiglu' keeps whole experts on each process; "
                             f"num_experts_per_device asks {sharded_count} processes to share one (use >= 1)")
        if isinstance(hidden_size_per_expert, bool) or not isinstance(hidden_size_per_expert, int) or \
                hidden_size_per_expert < 1:
            raise ValueError(f"experts option hidden_size_per_expert={hidden_size_per_expert!r} is not allowed: "
                             f"it must be an integer >= 1")
        if limit is not None and not (isinstance(limit, (int, float)) and limit > 0 and math.isfinite(limit)):
            raise ValueError(f"experts option limit={limit!r} is not allowed: a finite number > 0, or None")
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
            raise ValueError(f"experts option alpha={alpha!r} is not allowed: it must be a finite number")
        self.model_dim, self.output_dim = model_dim, model_dim
        self.hidden_size_per_expert = hidden_size_per_expert
        self.local_experts = num_experts_per_device
        self.sharded_count = 1
        self.alpha, self.limit, self.interleaved = float(alpha), limit, bool(interleaved)
        L, M, I = num_experts_per_device, model_dim, hidden_size_per_expert
        self.gate_up_proj = torch.nn.Parameter(torch.empty(L, M, 2 * I))
        self.down_proj = torch.nn.Parameter(torch.empty(L, I, M))
        if has_bias:
            self.gate_up_proj_bias = torch.nn.Parameter(torch.empty(L, 2 * I))
            self.down_proj_bias = torch.nn.Parameter(torch.empty(L, M))
        else:
            self.register_parameter("gate_up_proj_bias", None)
            self.register_parameter("down_proj_bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases."""
        with torch.no_grad():
            for param, fan_in in ((self.gate_up_proj, self.model_dim), (self.gate_up_proj_bias, self.model_dim),
                                  (self.down_proj, self.hidden_size_per_expert),
                                  (self.down_proj_bias, self.hidden_size_per_expert)):
                if param is not None:
                    bound = 1.0 / math.sqrt(fan_in)
                    param.uniform_(-bound, bound)

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, hidden_size_per_expert={self.hidden_size_per_expert}, "
                f"num_experts_per_device={self.local_experts}, alpha={self.alpha}, limit={self.limit}, "
                f"interleaved={self.interleaved}, has_bias={self.gate_up_proj_bias is not None}")

    def weights_for(self, ctx):
        """The four parameters used by this call: the local experts', or every process's experts
        when the call replicates all experts everywhere (adaptive_r = 0 over several processes)."""
        params = (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias)
        if getattr(ctx, "world_size", 1) > 1 and ctx.adaptive_degree == 0:
            return tuple(_gather_over(p, ctx.group, ctx.num_global_experts) for p in params)
        return params

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(u' + 1) * g' * sigmoid(alpha * g') on the [..., 2I] gate/up projection (fused on CPU:
        tutel.ops.gated_units)."""
        return gated_unit(gate_up, GatedUnit(self.alpha, 1.0, self.limit, self.interleaved))

    def _mlp(self, h: torch.Tensor, ctx, group_rows=None) -> torch.Tensor:
        w_gu, b_gu, w_down, b_down = self.weights_for(ctx)
        gate_up = linear_of_experts(h, w_gu, b_gu, False, group_rows)
        return linear_of_experts(self.activate(gate_up), w_down, b_down, False, group_rows)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        return run_padded(x, ctx, lambda h, group_rows: self._mlp(h, ctx, group_rows), self.model_dim,
                          self.model_dim)

    def forward_grouped(self, x: torch.Tensor, group_rows, ctx) -> torch.Tensor:
        """x: [N, *features] rows grouped by local expert (group_rows[e] rows each) -> same shape."""
        y = self._mlp(flatten_features(x, self.model_dim, self.model_dim, batch_dims=1), ctx, group_rows)
        return y.view(x.shape) if x.dim() > 2 else y


ExpertModule = ClampedSwiGLUExperts
