"""The public Tutel API: ``from tutel import moe``.

``moe_layer`` is the MoE layer; routing and dispatch (``top_k_routing``, ``fast_encode``, ``fast_decode``,
``fast_dispatcher``, ``fast_cumsum_sub_one``) are backed by the compiled
operators in ``torch.ops.tutel``.
"""
from .impls.fast_dispatch import (
    GatingDecoder,
    GatingEncoder,
    TutelMoeFastDispatcher,
    extract_critical,
    fast_decode,
    fast_dispatcher,
    fast_encode,
    get_dispatch_count,
)
from .gates.balancing import update_selection_biases
from .impls.moe_layer import MOELayer, moe_layer
from .jit_kernels.gating import fast_cumsum_sub_one

top_k_routing = extract_critical

__all__ = [
    "MOELayer",
    "GatingDecoder",
    "GatingEncoder",
    "TutelMoeFastDispatcher",
    "extract_critical",
    "fast_cumsum_sub_one",
    "fast_decode",
    "fast_dispatcher",
    "fast_encode",
    "get_dispatch_count",
    "moe_layer",
    "top_k_routing",
    "update_selection_biases",
]
