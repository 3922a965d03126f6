"""tutel's operators written as plain PyTorch operations (the "composite" path).

Each function here has the signature and the results of the operator of the
same name in ``torch.ops.tutel`` (see csrc/ops/schemas.cpp and csrc/core):
GShard slot order, the top-k tie and NaN rules, dropped choices, slots shared by
several choices summed in (choice, token) order, float32 accumulation for 16-bit
data.  They run on any device PyTorch supports, so they stand in for the CUDA
kernels where those cannot be compiled or loaded, or disagree with them (see
``tutel.ops.backend``).  Moves, counts and slots are bit for bit those of the
compiled operators; dot products, floating-point cumsums and the experts' row
sums are reductions that may be summed in another order.

``add_expert_bias_`` works in place and returns None, as the operator does.

Unlike the CUDA kernels, the routing and slot operators check caller-made
indices and locations at once, which synchronises with the host; so do the
data-dependent sizes of ``scatter_slots``.  They therefore cannot be captured
in a CUDA graph.  The experts' operators (experts.py, expert_rows.py) read no
value back and can, except ``grouped_rows_linear`` and its backward (grouped_rows.py) and
``decode_experts`` (decode_experts.py), ``decode_quantized_experts`` (decode_quantized_experts.py) and
``quantized_grouped_linear`` (quantized_grouped_linear.py), one matrix product per expert.  ``route_experts``
(route_experts.py) reads nothing back either; its weights and loss are differentiable through
autograd.
"""
from .cumsum import cumsum_sub_one
from .decode_experts import decode_experts
from .decode_quantized_experts import decode_quantized_experts
from .experts import (gated_unit, gated_unit_backward, gated_unit_pair, gated_unit_pair_backward,
                      group_by_expert)
from .expert_rows import add_expert_bias_, choice_rows, expert_row_sums
from .grouped_rows import grouped_rows_linear, grouped_rows_linear_backward
from .quantized_grouped_linear import quantized_grouped_linear
from .route_experts import route_experts
from .routing import assign_locations, route_topk
from .slots import gather_slots, scatter_slots

__all__ = ["add_expert_bias_", "assign_locations", "choice_rows", "cumsum_sub_one", "decode_experts",
           "decode_quantized_experts",
           "expert_row_sums", "gated_unit", "gated_unit_backward", "gated_unit_pair", "gated_unit_pair_backward",
           "gather_slots", "group_by_expert", "grouped_rows_linear", "grouped_rows_linear_backward",
           "quantized_grouped_linear", "route_experts",
           "route_topk", "scatter_slots"]
