"""The facts of a call (tutel.rules.paths.FACTS), built here and nowhere else: for moe_layer's calls
(``layer_facts``), for routed experts' (``experts_facts``), which transformers' "tutel" experts
make too, and for routed quantized experts' (``quantized_experts_facts``)."""
from typing import Dict, Optional

import torch

from ..ops.decode_experts import decode_experts_supported
from ..ops.quantized_experts import DECODE_DTYPES
from ..ops.tracing import _COMPILER_IS_COMPILING, direct_call_allowed, is_compiling
from ..rules.autocast import any_autocast, autocast_dtype
from ..rules.lines import MIN_PIECE_ROWS, QUANTIZED_DECODE_MAX_TOKENS
from .work import QuantizedExperts, WeightExperts


# The device fact by device type (a dict lookup: the facts are built on every call).
_DEVICE_KINDS = {"cpu": "cpu", "cuda": "cuda"}
# The dtypes PyTorch's matrix products (cuBLAS) take where its grouped_mm has no kernel (cublas_dtype).
_CUBLAS_DTYPES = frozenset((torch.float16, torch.float32, torch.float64))


def stream_capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream: never before PyTorch has
    initialised CUDA in this process (CUDA tensors there are fake ones of a trace, and asking a
    missing driver would raise)."""
    return torch.cuda._initialized and torch.cuda.is_current_stream_capturing()


def fits_one_call(rows: int) -> bool:
    """Whether inference of `rows` grouped rows runs in one operator call (experts_one_call): up to
    the rows of the smallest piece (tutel.rules.lines), where the calls' fixed costs still matter."""
    return rows <= MIN_PIECE_ROWS


def records_gradient(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether autograd records a call of `layer`: grad mode on and the tokens or a parameter require grad."""
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p.requires_grad for p in layer.parameters())


def uses_tutel_routing(layer: torch.nn.Module, gate: torch.nn.Module) -> bool:
    """Softmax top-k routing with the GShard loss and no gate noise in this call (Tutel's default)."""
    options = getattr(gate, "routing_options", None)
    return layer.is_gshard_loss and (options is None or options.is_default) and \
        not (layer.training and gate.gate_noise > 0)


def layer_facts(layer: torch.nn.Module, x: torch.Tensor, call, reserve_dims: int) -> Dict[str, object]:
    """The facts of a call of moe_layer `layer` on tokens x [T, M] with the call's resolved switches
    `call` (tutel.impls.call_settings.CallSettings)."""
    experts = layer.experts
    if call.capacity_factor > 0:
        capacity = "static"
    else:
        capacity = "dropless" if call.capacity_factor == 0 else "capped"
    device = _DEVICE_KINDS.get(x.device.type, "other")
    cublas_dtype = x.dtype in _CUBLAS_DTYPES
    traced = is_compiling()
    return {
        "device": device,
        "gradient": records_gradient(layer, x),
        "plain": not traced and direct_call_allowed(x),
        "traced": traced,
        # (asked only where a rule reads it: eager CUDA tokens of a cuBLAS dtype)
        "capturing": device == "cuda" and cublas_dtype and not traced and stream_capturing(),
        "cublas_dtype": cublas_dtype,
        "autocast": any_autocast() and autocast_dtype(x.device.type) is not None,
        "processes": "several" if layer.world_size > 1 else "one",
        "layout": "grouped" if call.megablocks_size > 0 else "padded",
        "capacity": capacity,
        "tutel_routing": uses_tutel_routing(layer, call.gate),
        "gate_at_combine": layer.is_postscore,
        "token_dims": "one" if reserve_dims == 1 else "several",
        "gated_experts": bool(getattr(experts, "offers_gated_weights", False)),
        "experts_in_pieces": bool(getattr(experts, "offers_grouped_products", False)),
        "experts_grouped": callable(getattr(experts, "forward_grouped", None)),
        "rows_fit_one_call": fits_one_call(x.shape[0] * call.top_k),
        "decode_kernel": decode_experts_supported(x.shape[0], call.top_k, x.dtype, x.device,
                                                  experts=layer.num_global_experts),
    }


def experts_facts(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                  experts: WeightExperts) -> Dict[str, object]:
    """The facts of a routed experts call for its tensors as they will be computed (after autocast
    and widening)."""
    up, down = experts.up_weight, experts.down_weight
    device = _DEVICE_KINDS.get(x.device.type, "other")
    cublas_dtype = x.dtype in _CUBLAS_DTYPES
    traced = _COMPILER_IS_COMPILING is not None and bool(_COMPILER_IS_COMPILING())  # (is_compiling, inline)
    return {
        "device": device,
        "gradient": torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weights, up, down, experts.up_bias, experts.down_bias)),
        "traced": traced,
        # (asked only where a rule reads it: eager CUDA tokens of a cuBLAS dtype)
        "capturing": device == "cuda" and cublas_dtype and not traced and stream_capturing(),
        "cublas_dtype": cublas_dtype,
        "gated_experts": experts.unit is not None and experts.post_fn is None and down.dtype == x.dtype,
        "rows_fit_one_call": fits_one_call(expert_ids.numel()),
        # (decode_experts_supported is False off CUDA: not asked there)
        "decode_kernel": device == "cuda" and decode_experts_supported(x.shape[0], expert_ids.shape[1], x.dtype,
                                                                       x.device, experts=experts.num_experts),
    }


def quantized_experts_facts(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                            experts: QuantizedExperts) -> Dict[str, object]:
    """The facts of a routed quantized experts call (tutel.paths.work.QuantizedExperts): their
    stacks are no matrices in the tokens' dtype, so neither the one-call operator nor the CUDA
    decode kernels take them (``gated_experts`` and ``decode_kernel`` do not hold), and they record
    no gradient of their own (their biases are refused with the tokens where autograd would record
    them), and no matrix product of PyTorch multiplies them (``cublas_dtype`` does not hold: on CUDA
    they keep their grouped products, which read nothing back, never the per-expert products that
    read the group ends on the host).  ``quantized_decode``: CPU or CUDA
    tokens of the decode operator's dtypes, up to its line, and experts it computes (asked last:
    their form is worked out on the first question)."""
    device = _DEVICE_KINDS.get(x.device.type, "other")
    traced = _COMPILER_IS_COMPILING is not None and bool(_COMPILER_IS_COMPILING())
    return {
        "device": device,
        "gradient": torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weights, experts.up_bias, experts.down_bias)),
        "traced": traced,
        "capturing": False,  # (asked only for a cublas_dtype)
        "cublas_dtype": False,
        "gated_experts": False,
        "rows_fit_one_call": fits_one_call(expert_ids.numel()),
        "decode_kernel": False,
        "quantized_decode": device != "other" and x.shape[0] <= QUANTIZED_DECODE_MAX_TOKENS and
        x.dtype in DECODE_DTYPES and experts.decode_form() is not None,
    }
