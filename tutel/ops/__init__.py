"""Functional, autograd-aware access to tutel's compiled operators.

Routing metadata is passed as stacked tensors: ``indices`` and ``locations`` of
shape ``[k, tokens]`` (choice-major) and optional ``gates`` of the same shape.
The expert buffer is ``[num_experts, capacity, model_dim]``.
"""
from . import fake as _fake  # noqa: F401  (registers shape functions for torch.compile)
from .cumsum import cumsum_sub_one
from .dispatch import decode, encode, encode_grouped
from .linear import expert_linear
from .routing import RoutingResult, assign_locations, route_topk

__all__ = [
    "RoutingResult",
    "assign_locations",
    "cumsum_sub_one",
    "decode",
    "encode",
    "encode_grouped",
    "expert_linear",
    "route_topk",
]
