"""What a moe_layer call hands to its experts, and what each of its paths hands back."""
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch


class CallContext:
    """The ``ctx`` an experts module receives for one call: the layer's attributes, with this call's
    values for the per-call ones (``adaptive_degree``, ``a2a_ffn_overlap_degree``,
    ``megablocks_size``, ``dispatch_count`` / ``local_dispatch_count``).

    Tutel's custom experts read these from ``ctx``; giving them a context per call, instead of
    setting the values on the layer for the call's duration, leaves the layer itself unchanged
    whatever the call does (and safe to call from two threads)."""

    def __init__(self, layer: torch.nn.Module, **call_values: Any):
        # attribute by attribute, not through __dict__: PyTorch 2.6's torch.compile cannot trace that
        self.layer = layer
        for name, value in call_values.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:  # only for names this call does not set
        if name == "layer":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.layer, name)


class LayerResult(NamedTuple):
    """What one path of moe_layer computed."""

    output: torch.Tensor                 # [T, O] the combined experts' outputs (O: all feature dims)
    features: Tuple[int, ...]            # the shape of one token's output features
    l_aux: Optional[torch.Tensor]        # the auxiliary loss
    dispatch_count: torch.Tensor         # [E] int64: choices routed to each expert, dropped ones included
    weights: Sequence[torch.Tensor]      # k [T] routing weights: choice j's of every token
    logits: Optional[torch.Tensor]       # [T, E] the gate's logits
