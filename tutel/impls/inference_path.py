"""moe_layer's forward without autograd at the sizes its experts run in one operator call: the
routing in one call of ``tutel._C.route_without_grad``, the experts in one of
``routed_gated_experts``.

The general forward builds Tutel's crit tuple (k lists of [T] tensors, the capacity, the counts),
normalizes the gates and computes the GShard loss in a dozen small PyTorch operators, then
rebuilds [k, T] tables from the lists for the experts.  Decoding one token, with the caches cold
after the other layers' weights streamed through them, those calls and the Python around them took
0.6 of the 1.9 ms of a DeepSeek-like bfloat16 layer.  Here the same steps run in C++ with the same
rounding (csrc/ops/cpu/routing_cpu.cpp); every call this path does not cover takes the general
forward.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .._extension import load_extension
from ..experts.routed import fits_one_call, gated_experts_in_one_call
from ..ops.precision import gemm_dtype
from ..ops.tracing import direct_call_allowed, is_compiling
from .autocast import autocast_dtype
from .capacity import capacity_alignment, expert_capacity


class InferenceResult(NamedTuple):
    output: torch.Tensor          # [T, O] in x's dtype
    l_aux: torch.Tensor           # the GShard loss, 0-dim
    dispatch_count: torch.Tensor  # [E] int64: choices per expert, dropped ones included


def covers(layer, x: torch.Tensor, gate, capacity_factor: float, megablocks_size: int, reserve_dims: int) -> bool:
    """Whether the call can take this path: CPU, eager, no gradient recorded, one process, autocast
    off, the default softmax top-k routing with the GShard loss (no gate noise in training, no scored
    routing options), a static or dropless capacity, the grouped layout (megablocks_size > 0) with
    the gate applied at the combine, and SwiGLU experts that hand over their matrices."""
    if torch.is_grad_enabled() or x.device.type != "cpu" or is_compiling():
        return False
    if layer.world_size != 1 or reserve_dims != 1 or megablocks_size <= 0 or capacity_factor < 0:
        return False
    if not (layer.is_postscore and layer.is_gshard_loss) or autocast_dtype("cpu") is not None:
        return False
    if layer.training and gate.gate_noise > 0:
        return False
    options = getattr(gate, "routing_options", None)
    if options is not None and not options.is_default:
        return False
    return callable(getattr(layer.experts, "gated_weights", None)) and direct_call_allowed(x)


def forward_without_grad(layer, x: torch.Tensor, gate, top_k: int, capacity_factor: float, overlap: int,
                         megablocks_size: int) -> Optional[InferenceResult]:
    """The layer's output for the tokens x [T, M] (already in the compute dtype) with this call's
    settings, or None where the experts do not run in one call (covers() checked by the caller)."""
    tokens, num_experts = x.shape[0], layer.num_global_experts
    if not fits_one_call(tokens * top_k):
        return None
    dtype = gemm_dtype(x.dtype, x.device, tokens * top_k / max(num_experts, 1))
    weights = layer.experts.gated_weights(layer, dtype)
    if weights is None:
        return None
    logits = gate(x)
    if logits.dim() != 2 or logits.shape != (tokens, num_experts):
        raise ValueError(f"gate returned logits of shape {tuple(logits.shape)}; expected "
                         f"[tokens, num_global_experts] = [{tokens}, {num_experts}]")
    scores = F.softmax(logits, dim=1)
    capacity = -1  # dropless: nothing is dropped
    if capacity_factor > 0:
        alignment = capacity_alignment(layer.sharded_count, overlap, megablocks_size)
        capacity = expert_capacity(capacity_factor, top_k, tokens, num_experts, alignment=alignment)
    expert_ids, gates, dispatch_count, l_aux = _route_without_grad(
        scores, top_k, top_k > 1 and layer.normalize_gate, capacity, layer.batch_prioritized_routing)
    gate_w, up_w, down_w = weights
    y = gated_experts_in_one_call(x.to(dtype), expert_ids, gates, up_w, down_w, gate_weight=gate_w, transposed=True)
    layer.protected_shape = y.shape
    return InferenceResult(y.to(x.dtype), l_aux, dispatch_count)


_route_without_grad = load_extension().route_without_grad
