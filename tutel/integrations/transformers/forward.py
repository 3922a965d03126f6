"""The experts forward registered in transformers' ExpertsInterface under the name "tutel".

transformers calls it as ``forward(self, hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`` with ``self`` the model's experts module; the router stays the
model's own.  Routing metadata, dispatch, the grouped expert GEMMs and the combine run in
``tutel.experts.routed_experts``.
"""
import torch

from ...experts.routed import routed_experts
from .layout import read_layout
from .one_call import one_call_forward


def _check_call(module: torch.nn.Module, hidden_states, top_k_index, top_k_weights) -> None:
    """The call's arguments, with the module class in the message."""
    for name, value in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                        ("top_k_weights", top_k_weights)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f'experts_implementation="tutel": {type(module).__name__} was called with '
                            f"`{name}` of type {type(value).__name__}, expected a tensor")
    if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape \
            or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f'experts_implementation="tutel": {type(module).__name__} expects hidden_states [T, H], '
                         f"top_k_index [T, k] and top_k_weights [T, k]; got {tuple(hidden_states.shape)}, "
                         f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")


def tutel_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Runs a transformers experts module (``self``) through tutel's routed experts.

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
    """
    out = one_call_forward(self, hidden_states, top_k_index, top_k_weights)  # CPU inference's shortcut
    if out is not None:
        return out
    _check_call(self, hidden_states, top_k_index, top_k_weights)
    layout = read_layout(self)
    width = layout.model_dim
    if hidden_states.shape[1] != width:
        raise ValueError(f'experts_implementation="tutel": {type(self).__name__} takes tokens of {width} features, '
                         f"got hidden_states {tuple(hidden_states.shape)}")
    weights = top_k_weights
    if layout.expert_parallel:
        # Choices owned by other processes: routed_experts already skips ids outside [0, E); the
        # zero weight also keeps them out of the router's gradient.
        weights = weights.masked_fill(top_k_index >= layout.num_experts, 0.0)
    # Routers that compute in float32 hand float32 weights to float64 tokens: widened, so the
    # product keeps the tokens' precision as in the eager experts (wider weights pass as they are).
    if weights.dtype != hidden_states.dtype and weights.dtype.itemsize < hidden_states.dtype.itemsize:
        weights = weights.to(hidden_states.dtype)
    return routed_experts(hidden_states, top_k_index, weights, layout.up_weight, layout.down_weight,
                          up_bias=layout.up_bias, down_bias=layout.down_bias, transposed=layout.transposed,
                          gate=layout.gate, gate_fn=layout.gate_fn, activation=layout.activation,
                          post_fn=layout.post_fn)

