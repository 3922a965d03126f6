"""SwiGLU experts as in LLaMA (Tutel's ``{'type': 'llama_ffn'}``): y = (act(x W1) * (x W2)) W3."""
from typing import Callable, Tuple

import torch
import torch.nn.functional as F

from ..ops.linear import linear_of_experts
from ..ops.gated_units import SWIGLU, apply_gated_unit_pair
from ..ops.grouped_mm import grouped_rows_mm, grouped_rows_mm_eager
from ..ops.precision import widened
from ..ops.tracing import eager_without_grad
from ._grouped import flatten_features, run_padded


class LlamaFFNNetwork(torch.nn.Module):
    """Gated MLP experts without biases.

    Parameters (Tutel's layout): ``W_fc1`` and ``W_fc2`` of full shape [L, model_dim, H] and
    ``W_fc3`` of full shape [L, H, model_dim], each stored as a flat 1-D shard of
    ceil(numel / S) elements (S = sharded_count processes share the experts; with S = 1 the
    shard is the whole tensor).  Initialised N(0, 0.01).

    Shared experts (S > 1) are gathered whole on each of their processes for every call, so
    with adaptive_r = r > 1 the r replicas of a token each compute the full output (and are
    averaged); adaptive_r = 1 does the least work for these experts.
    """

    def __init__(self, model_dim: int, hidden_size_per_expert: int, num_experts_per_device: int,
                 sharded_count: int = 1, activation_fn: Callable = F.silu):
        super().__init__()
        self.model_dim = model_dim
        self.hidden_size_per_expert = hidden_size_per_expert
        self.local_experts = num_experts_per_device
        self.sharded_count = sharded_count
        self.activation_fn = activation_fn
        self.full_shapes = {
            "W_fc1": (num_experts_per_device, model_dim, hidden_size_per_expert),
            "W_fc2": (num_experts_per_device, model_dim, hidden_size_per_expert),
            "W_fc3": (num_experts_per_device, hidden_size_per_expert, model_dim),
        }
        for name, shape in self.full_shapes.items():
            numel = shape[0] * shape[1] * shape[2]
            shard = torch.empty(-(-numel // sharded_count))
            torch.nn.init.normal_(shard, 0, 0.01)
            self.register_parameter(name, torch.nn.Parameter(shard))

    def extra_repr(self) -> str:
        return ".."

    def full_weights(self, ctx):
        """The three weights at their full [L, ., .] shape for this call."""
        from .sharding import llama_weights_for_call
        return llama_weights_for_call(self, ctx)

    def _swiglu(self, h: torch.Tensor, ctx, group_rows=None) -> torch.Tensor:
        """act(h W1) * (h W2) W3 on [L, C, M] (or grouped [N, M] rows with `group_rows`)."""
        w1, w2, w3 = self.full_weights(ctx)
        gate = linear_of_experts(h, w1, None, False, group_rows)
        up = linear_of_experts(h, w2, None, False, group_rows)
        return linear_of_experts(self._gated(gate, up), w3, None, False, group_rows)

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up: one fused pass (forward and backward) for the default SiLU."""
        if self.activation_fn is F.silu:
            return apply_gated_unit_pair(gate, up, SWIGLU)
        return self.activation_fn(gate) * up

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        y = run_padded(x, ctx, lambda h, group_rows: self._swiglu(h, ctx, group_rows), self.model_dim,
                       self.model_dim)
        replicas = getattr(ctx, "adaptive_degree", 1)
        if getattr(ctx, "world_size", 1) > 1 and self.sharded_count > 1 and replicas > 1:
            # These experts gather the whole expert instead of splitting the hidden dim, so each of
            # the r replicas of a token computes the full output; the layer sums the replicas.
            y = y / replicas
        return y

    def forward_grouped(self, x: torch.Tensor, group_rows, ctx) -> torch.Tensor:
        """x: [N, *features] rows grouped by local expert (group_rows[e] rows each) -> same shape."""
        y = self._swiglu(flatten_features(x, self.model_dim, self.model_dim, batch_dims=1), ctx, group_rows)
        return y.view(x.shape) if x.dim() > 2 else y

    offers_grouped_products = True

    @property
    def offers_gated_weights(self) -> bool:
        """Whether gated_weights applies: the activation is SiLU (the fused unit)."""
        return self.activation_fn is F.silu

    def gated_weights(self, ctx, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W1, W2, W3) in `dtype` for inference in one operator call (tutel.paths)."""
        return self._weights_in(ctx, dtype)

    def _weights_in(self, ctx, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The call's three weights in `dtype` (tutel.ops.precision.widened)."""
        w1, w2, w3 = self.full_weights(ctx)
        if w1.dtype == w2.dtype == w3.dtype == dtype:  # (the common case, without three calls)
            return w1, w2, w3
        return widened(w1, dtype), widened(w2, dtype), widened(w3, dtype)

    def grouped_products(self, ctx, dtype: torch.dtype) -> Tuple[Callable, int]:
        """``(run, row_bytes)`` for the grouped path without autograd (tutel.paths):
        ``run(rows, plan)`` computes every grouped row's expert with the weights in `dtype`;
        `row_bytes` is one row's gate and up intermediates."""
        w1, w2, w3 = self._weights_in(ctx, dtype)

        def run(rows: torch.Tensor, plan) -> torch.Tensor:
            # Only the plan's kept rows are read back: the rows past them are left unspecified.  The
            # products skip the custom operator where nothing records or traces (asked once).
            product = grouped_rows_mm_eager if eager_without_grad(rows, w1, w2, w3) else grouped_rows_mm
            gate = product(rows, w1, plan.offsets, True, zero_tail=False)
            hidden = self._gated(gate, product(rows, w2, plan.offsets, True, zero_tail=False))
            return product(hidden, w3, plan.offsets, True, zero_tail=False)

        return run, 2 * self.hidden_size_per_expert * w1.element_size()


ExpertModule = LlamaFFNNetwork
