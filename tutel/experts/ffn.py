"""The fused feed-forward experts (Tutel's ``{'type': 'ffn'}``): y = act(x W1^T + b1) W2 + b2,
computed for all local experts with batched matrix products."""
import os
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ..ops.linear import linear_of_experts
from ..ops.grouped_mm import grouped_rows_mm, grouped_rows_mm_eager
from ..ops.precision import widened
from ..ops.tracing import eager_without_grad
from ._grouped import flatten_features, run_padded


class FusedExpertsNetwork(torch.nn.Module):
    """``num_experts_per_device`` two-layer MLP experts stored as batched tensors.

    Parameters (state_dict keys, Tutel's layout):
        batched_fc1_w    [L, H/S, model_dim]   (nn.Linear layout)
        batched_fc2_w    [L, H/S, output_dim]  (transposed layout)
        batched_fc1_bias [L, H/S]
        batched_fc2_bias [L, ceil(output_dim/S)]
    where L = local experts, H = hidden_size_per_expert and S = sharded_count
    (processes sharing one expert, each holding a slice of the hidden dimension).

    Args:
        activation_fn: act(x); default ReLU.
        activation_fn_with_self: act(x, module) instead of activation_fn (not both).
        output_dim: expert output size (default model_dim).
        has_fc1_bias, has_fc2_bias: create the biases (else registered as None).
    """

    def __init__(self, model_dim: int, hidden_size_per_expert: int, num_experts_per_device: int,
                 sharded_count: int = 1, activation_fn: Optional[Callable] = None,
                 activation_fn_with_self: Optional[Callable] = None, output_dim: Optional[int] = None,
                 has_fc1_bias: bool = True, has_fc2_bias: bool = True):
        super().__init__()
        if hidden_size_per_expert % sharded_count != 0:
            raise ValueError(f"Can't evenly divide hidden_size_per_expert ({hidden_size_per_expert}) into "
                             f"{sharded_count} slices (one per process sharing an expert)")
        if activation_fn is not None and activation_fn_with_self is not None:
            raise ValueError("Option `activation_fn_with_self` has been specified, please keep exactly one of "
                             "`activation_fn` and `activation_fn_with_self`")
        self.skip_expert = int(os.environ.get("SKIP_EXPERT", "0")) != 0
        self.model_dim = model_dim
        self.hidden_size_per_expert = hidden_size_per_expert
        self.local_experts = num_experts_per_device
        self.sharded_count = sharded_count
        self.hidden_size = hidden_size_per_expert // sharded_count
        self.output_dim = output_dim or model_dim
        self.activation_fn = activation_fn
        self.activation_fn_with_self = activation_fn_with_self

        L, H = num_experts_per_device, self.hidden_size
        self.batched_fc1_w = torch.nn.Parameter(torch.empty(L, H, model_dim))
        self.batched_fc2_w = torch.nn.Parameter(torch.empty(L, H, self.output_dim))
        if has_fc1_bias:
            self.batched_fc1_bias = torch.nn.Parameter(torch.empty(L, H))
        else:
            self.register_parameter("batched_fc1_bias", None)
        if has_fc2_bias:
            self.batched_fc2_bias = torch.nn.Parameter(torch.empty(L, -(-self.output_dim // sharded_count)))
        else:
            self.register_parameter("batched_fc2_bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialises each local expert like a fresh pair of nn.Linear layers (Tutel's scheme)."""
        with torch.no_grad():
            for i in range(self.batched_fc1_w.size(0)):
                fc1 = torch.nn.Linear(self.model_dim, self.hidden_size, bias=self.batched_fc1_bias is not None)
                fc2 = torch.nn.Linear(self.hidden_size, self.output_dim, bias=self.batched_fc2_bias is not None)
                self.batched_fc1_w[i] = fc1.weight
                if self.batched_fc1_bias is not None:
                    self.batched_fc1_bias[i] = fc1.bias
                self.batched_fc2_w[i] = fc2.weight.t()
                if self.batched_fc2_bias is not None:
                    self.batched_fc2_bias[i] = fc2.bias[:self.batched_fc2_bias.size(-1)]

    def extra_repr(self) -> str:
        return "model_dim=%d, hidden_size=%d, output_dim=%d, num_experts_per_device=%d has_fc1_bias=%s, has_fc2_bias=%s" % (
            self.model_dim, self.hidden_size, self.output_dim, self.local_experts,
            self.batched_fc1_bias is not None, self.batched_fc2_bias is not None)

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_fn_with_self is not None:
            return self.activation_fn_with_self(x, self)
        if self.activation_fn is not None:
            return self.activation_fn(x)
        return F.relu(x)

    def weights_for(self, ctx):
        """(fc1_w [L', H', M], fc2_w [L', H', O], fc1_b [L', H'] or None, fc2_b [L', O] or None)
        as used by this call (whole local experts in a single process)."""
        from .sharding import ffn_weights_for_call
        return ffn_weights_for_call(self, ctx)

    def _mlp(self, h: torch.Tensor, ctx, group_rows=None) -> torch.Tensor:
        """The two linear layers on [L, C, M] (or grouped [N, M] rows with `group_rows`)."""
        fc1_w, fc2_w, fc1_b, fc2_b = self.weights_for(ctx)
        h = linear_of_experts(h, fc1_w, fc1_b, True, group_rows)
        return linear_of_experts(self._activate_output(h), fc2_w, fc2_b, False, group_rows)

    def _activate_output(self, h: torch.Tensor) -> torch.Tensor:
        """The activation of the first product's output h, which nothing else keeps: the default
        ReLU runs in place (the products keep their inputs, not its output)."""
        return F.relu_(h) if self.activation_fn is None and self.activation_fn_with_self is None else self.activate(h)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if self.skip_expert:
            return x
        return run_padded(x, ctx, lambda h, group_rows: self._mlp(h, ctx, group_rows), self.model_dim,
                          self.output_dim)

    def forward_grouped(self, x: torch.Tensor, group_rows, ctx) -> torch.Tensor:
        """x: [N, *features] rows grouped by local expert (group_rows[e] rows each) -> [N, *out]."""
        if self.skip_expert:
            return x
        y = self._mlp(flatten_features(x, self.model_dim, self.output_dim, batch_dims=1), ctx, group_rows)
        return y.view(x.shape) if x.dim() > 2 else y

    @property
    def offers_grouped_products(self) -> bool:
        """Whether grouped_products applies (not with SKIP_EXPERT, where the experts are the identity)."""
        return not self.skip_expert

    def grouped_products(self, ctx, dtype: torch.dtype) -> Tuple[Callable, int]:
        """``(run, row_bytes)`` for the grouped path without autograd (tutel.paths):
        ``run(rows, plan)`` computes every grouped row's expert with the parameters in `dtype`;
        `row_bytes` is one row's hidden activations."""
        fc1_w, fc2_w, fc1_b, fc2_b = self.weights_for(ctx)
        fc1_w, fc2_w = widened(fc1_w, dtype), widened(fc2_w, dtype)
        fc1_b = None if fc1_b is None else widened(fc1_b, dtype)
        fc2_b = None if fc2_b is None else widened(fc2_b, dtype)

        def run(rows: torch.Tensor, plan) -> torch.Tensor:
            # Only the plan's kept rows are read back (zero_tail=False).  The products skip the custom
            # operator where nothing records or traces (asked once).
            product = grouped_rows_mm_eager if eager_without_grad(rows, fc1_w, fc2_w, fc1_b, fc2_b) \
                else grouped_rows_mm
            h = product(rows, fc1_w, plan.offsets, False, fc1_b, zero_tail=False)
            return product(self._activate_output(h), fc2_w, plan.offsets, True, fc2_b, zero_tail=False)

        return run, fc1_w.shape[1] * fc1_w.element_size()


ExpertModule = FusedExpertsNetwork
