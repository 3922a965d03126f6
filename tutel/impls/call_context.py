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
        self.__dict__.update(call_values)
        self.__dict__["layer"] = layer

    def __getattr__(self, name: str) -> Any:  # only for names this call does not set
        return getattr(self.__dict__["layer"], name)


class LayerResult(NamedTuple):
    """What one path of moe_layer computed."""

    output: torch.Tensor                 # [T, O] the combined experts' outputs (O: all feature dims)
    features: Tuple[int, ...]            # the shape of one token's output features
    l_aux: Optional[torch.Tensor]        # the auxiliary loss
    dispatch_count: torch.Tensor         # [E] int64: choices routed to each expert, dropped ones included
    weights: Sequence[torch.Tensor]      # k [T] routing weights: choice j's of every token
    logits: Optional[torch.Tensor]       # [T, E] the gate's logits
