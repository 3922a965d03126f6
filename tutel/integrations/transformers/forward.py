"""The experts forward registered in transformers' ExpertsInterface under the name "tutel".

transformers calls it as ``forward(self, hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`` with ``self`` the model's experts module; the router stays the
model's own.  The module's layout is read once per state of the module
(``module_experts.kept_layout``); routing metadata, dispatch, the grouped expert GEMMs and the combine
run in tutel's routed experts (``tutel.experts.routed.run_routed``, on tutel.paths).
"""
from typing import Callable

import torch

from ...experts.routed import run_routed
from .module_experts import kept_layout


def _reject_call(module: torch.nn.Module, width: int, hidden_states, top_k_index, top_k_weights) -> None:
    """Raises for a call the forward's inline check rejects, naming the argument and the module class (the
    module's own tensors were checked when its layout was read)."""
    where = f'experts_implementation="tutel": {type(module).__name__}'
    for name, value in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                        ("top_k_weights", top_k_weights)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} was called with `{name}` of type {type(value).__name__}, expected a tensor")
    if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape \
            or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"{where} expects hidden_states [T, H], top_k_index [T, k] and top_k_weights [T, k]; got "
                         f"{tuple(hidden_states.shape)}, {tuple(top_k_index.shape)} and "
                         f"{tuple(top_k_weights.shape)}")
    if hidden_states.shape[1] != width:
        raise ValueError(f"{where} takes tokens of {width} features, got hidden_states {tuple(hidden_states.shape)}")
    if not hidden_states.is_floating_point() or not top_k_weights.is_floating_point():
        raise TypeError(f"{where}: `hidden_states` and `top_k_weights` must be floating point, got "
                        f"{hidden_states.dtype} and {top_k_weights.dtype}")
    raise TypeError(f"{where}: `top_k_index` must hold integer expert ids, got {top_k_index.dtype}")


def experts_forward(read_layout: Callable, run_experts: Callable, name: str, doc: str) -> Callable:
    """A forward for transformers' experts registries (``forward(self, hidden_states, top_k_index,
    top_k_weights)``) that reads its module with ``read_layout(module)`` (a kept layout: model_dim,
    num_experts, expert_parallel and ``experts()``) and computes with ``run_experts(hidden_states,
    top_k_index, weights, experts)``: one body for the float and the FP8 experts (the call's checks,
    the expert-parallel mask, the weights' widening), and no call of its own around them."""
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        read = read_layout(self)
        width = read.model_dim
        # The call's arguments, checked inline (every call; _reject_call builds the messages of one that fails).
        if not (isinstance(hidden_states, torch.Tensor) and isinstance(top_k_index, torch.Tensor) and
                isinstance(top_k_weights, torch.Tensor) and hidden_states.dim() == 2 and top_k_index.dim() == 2 and
                top_k_weights.shape == top_k_index.shape and top_k_index.shape[0] == hidden_states.shape[0] and
                hidden_states.shape[1] == width and hidden_states.is_floating_point() and
                top_k_weights.is_floating_point() and not top_k_index.is_floating_point() and
                not top_k_index.is_complex() and top_k_index.dtype != torch.bool):
            _reject_call(self, width, hidden_states, top_k_index, top_k_weights)
        weights = top_k_weights
        if read.expert_parallel:
            # Choices owned by other processes: the experts already skip ids outside [0, E); the
            # zero weight also keeps them out of the router's gradient.
            weights = weights.masked_fill(top_k_index >= read.num_experts, 0.0)
        # Routers that compute in float32 hand float32 weights to float64 tokens: widened, so the
        # product keeps the tokens' precision as in the eager experts (wider weights pass as they are).
        if weights.dtype != hidden_states.dtype and weights.dtype.itemsize < hidden_states.dtype.itemsize:
            weights = weights.to(hidden_states.dtype)
        return run_experts(hidden_states, top_k_index, weights, read.experts())

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = doc
    return forward


tutel_experts_forward = experts_forward(kept_layout, run_routed, "tutel_experts_forward", """\
Runs a transformers experts module (``self``) through tutel's routed experts.

Args:
    self: an experts module whose class is decorated with ``@use_experts_implementation``.
    hidden_states: [T, H] tokens.
    top_k_index: [T, k] chosen experts (local ids; with expert parallelism, ids >= the local
        ``num_experts`` mark choices other processes compute and contribute nothing here).
    top_k_weights: [T, k] routing weights.

Returns:
    [T, H] in ``hidden_states``' dtype: sum over the k choices of weight * expert output.

Raises:
    UnsupportedExpertsLayout: the module's flags describe experts tutel cannot run.
""")
