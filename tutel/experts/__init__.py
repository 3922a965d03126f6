"""Built-in experts, selected in ``moe_layer(experts={'type': <module name>, ...})``.

Each module exposes ``ExpertModule``: a torch.nn.Module built with
``model_dim``, ``num_experts_per_device`` (experts held by this process),
``sharded_count`` (processes sharing one expert) and its own options, and
called as ``forward(x [local_experts, tokens, *features], ctx)`` where ``ctx``
is the call's context: the MoE layer's attributes (``sharded_count``, ``group``,
``num_global_experts``, ``model_dim``, ...) with this call's ``adaptive_degree``,
``a2a_ffn_overlap_degree``, ``megablocks_size`` and ``dispatch_count``.

What an experts module may offer besides ``forward`` (tutel.rules.paths chooses by them):

* ``forward_grouped(rows [N, *features], group_rows, ctx)``: the experts on rows grouped by
  expert (``megablocks_size > 0``), through autograd;
* ``offers_grouped_products`` (True) and ``grouped_products(ctx, dtype) -> (run, row_bytes)``:
  ``run(rows, plan)`` computes grouped rows without autograd (CPU inference in pieces);
* ``offers_gated_weights`` (True) and ``gated_weights(ctx, dtype) -> (gate, up, down)``: SwiGLU
  matrices for one call of the ``routed_gated_experts`` operator.
"""
from .clamped_swiglu import ClampedSwiGLUExperts
from .ffn import FusedExpertsNetwork
from .llama_ffn import LlamaFFNNetwork
from .quantized import routed_quantized_experts
from .quantized_swiglu import QuantizedSwiGLUExperts
from .routed import routed_experts
from .shared import SharedExperts

__all__ = ["ClampedSwiGLUExperts", "FusedExpertsNetwork", "LlamaFFNNetwork", "QuantizedSwiGLUExperts", "SharedExperts",
           "routed_experts", "routed_quantized_experts"]
