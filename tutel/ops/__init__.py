"""Functional, autograd-aware access to tutel's compiled operators.

Routing metadata is passed as stacked tensors: ``indices`` and ``locations`` of
shape ``[k, tokens]`` (choice-major) and optional ``gates`` of the same shape.
The expert buffer is ``[num_experts, capacity, model_dim]``.

tutel.ops is the only package that reaches the compiled extension (tutel._C) and
``torch.ops.tutel``: the rest of tutel takes them from here (``extension``, ``direct``,
``cuda_runtime``, ``backend.compiled_operators``; ``registry`` lists every operator).
"""
from .extension import load_extension as _load_extension

_load_extension()  # first: the modules below register fake kernels and autograd on its operators

from . import fake as _fake  # noqa: E402,F401  (registers shape functions for torch.compile)
from .cumsum import cumsum_sub_one  # noqa: E402
from .dispatch import decode, encode, encode_grouped  # noqa: E402
from .linear import expert_linear  # noqa: E402
from .routing import RoutingResult, assign_locations, route_topk  # noqa: E402
from .tutel_gating_calls import (deepseek_moe_sigmoid_scaled_topk, kimi_moe_sigmoid_scaled_topk,  # noqa: E402
                                 qwen3_moe_scaled_topk)

__all__ = [
    "RoutingResult",
    "assign_locations",
    "cumsum_sub_one",
    "decode",
    "deepseek_moe_sigmoid_scaled_topk",
    "encode",
    "encode_grouped",
    "expert_linear",
    "kimi_moe_sigmoid_scaled_topk",
    "qwen3_moe_scaled_topk",
    "route_topk",
]
