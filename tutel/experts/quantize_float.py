"""Float SwiGLU experts -> quantized ones: ``quantize_experts(experts, format, **options)`` quantizes the
matrices of ``llama_ffn`` (LlamaFFNNetwork) or ``clamped_swiglu`` (ClampedSwiGLUExperts) experts
into tutel.quant stacks and returns a QuantizedSwiGLUExperts holding them (``moe_layer.quantize_experts``
puts it in place of the float module).

The float layouts ([L, H, I] matrices used as x @ W) are transposed into the stacks' (E, out, in):
llama_ffn's W1 and W2 become the stacks ``gate_weight`` and ``up`` (quantized apart, as checkpoints of
LLaMA-style models store them) and W3 ``down``; clamped_swiglu's gate_up_proj becomes one fused ``up``
stack in its own row order (interleaved or concatenated) with its biases kept in the float dtype.
"""
from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F

from ..ops.gated_units import SWIGLU, GatedUnit
from ..ops.quantized_experts import WEIGHT_ONLY
from ..quant import FORMATS
from .clamped_swiglu import ClampedSwiGLUExperts
from .llama_ffn import LlamaFFNNetwork
from .quantized_swiglu import QuantizedSwiGLUExperts

WHERE = "quantize_experts"
# The keyword options each format's quantizer takes (tutel.quant's quantize classmethods).
FORMAT_OPTIONS: Dict[str, Tuple[str, ...]] = {"fp8_block": ("block", "scale_dtype"), "mxfp4": (), "nvfp4": ()}
# The elements that share one scale along K in the FP4 formats: K must be a multiple.
_K_MULTIPLE = {"mxfp4": 32, "nvfp4": 16}


def check_format(format: object, options: Dict[str, Any]) -> None:
    """ValueError naming `format` or the option when the format or an option is not known."""
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(f"{WHERE}: format={format!r} is not allowed; expected one of {sorted(FORMATS)}")
    unknown = sorted(set(options) - set(FORMAT_OPTIONS[format]))
    if unknown:
        allowed = ", ".join(FORMAT_OPTIONS[format]) or "none"
        raise ValueError(f"{WHERE}: option(s) {unknown} are not allowed for format {format!r}; allowed: {allowed}")


def _check_widths(format: str, widths: Dict[str, int]) -> None:
    multiple = _K_MULTIPLE.get(format)
    for name, width in widths.items():
        if multiple is not None and width % multiple:
            raise ValueError(f"{WHERE}: format {format!r} scales every {multiple} elements along a matrix's "
                             f"inputs, so {name} must be a multiple of {multiple}, got {name}={width}")


def quantize_experts(experts: torch.nn.Module, format: str, *, activations: str = WEIGHT_ONLY,
                     **format_options: Any) -> QuantizedSwiGLUExperts:
    """Quantized experts computing what `experts` computes, within the format's precision.

    Args:
        experts: a ``llama_ffn`` or ``clamped_swiglu`` experts module holding whole experts
            (sharded_count 1).
        format: "fp8_block", "mxfp4" or "nvfp4" (tutel.quant.FORMATS).
        activations: "weight_only", or "dynamic" (W8A8; "fp8_block" only).
        **format_options: the format quantizer's options: ``block`` (default (128, 128)) and
            ``scale_dtype`` (default float32) for "fp8_block"; none for the FP4 formats.

    Returns:
        QuantizedSwiGLUExperts on the experts' device (`experts` itself is left unchanged).

    Raises:
        ValueError: an unknown format or option, experts shared over processes, a model_dim or
            hidden_size_per_expert that is no multiple of the format's scale group (32 for
            "mxfp4", 16 for "nvfp4"), or weights the format cannot hold (non-finite values).
        TypeError: experts of another type.
    """
    check_format(format, format_options)
    if not isinstance(experts, (LlamaFFNNetwork, ClampedSwiGLUExperts)):
        raise TypeError(f"{WHERE}: experts of type {type(experts).__name__} cannot be quantized; llama_ffn "
                        f"(LlamaFFNNetwork) and clamped_swiglu (ClampedSwiGLUExperts) experts can")
    if experts.sharded_count != 1:
        raise ValueError(f"{WHERE}: the experts are shared over {experts.sharded_count} processes (a negative "
                         f"num_experts_per_device); quantized experts keep whole experts on each process")
    stack_class = FORMATS[format]
    model_dim, hidden = experts.model_dim, experts.hidden_size_per_expert
    _check_widths(format, {"model_dim": model_dim, "hidden_size_per_expert": hidden})

    def quantize(weight: torch.Tensor, **rows: Any):
        # [L, in, out] as x @ W -> the stack's (E, out, in)
        return stack_class.quantize(weight.detach().transpose(1, 2), **rows, **format_options)

    with torch.no_grad():
        if isinstance(experts, LlamaFFNNetwork):
            # whole experts (sharded_count 1): each flat parameter is exactly its full shape
            w1, w2, w3 = (getattr(experts, name).view(shape) for name, shape in experts.full_shapes.items())
            silu = experts.activation_fn is F.silu
            return QuantizedSwiGLUExperts(model_dim, experts.local_experts, up=quantize(w2), down=quantize(w3),
                                          gate_weight=quantize(w1), unit=SWIGLU,
                                          activation_fn=None if silu else experts.activation_fn,
                                          activations=activations)
        rows = "interleaved" if experts.interleaved else "concatenated"
        unit = GatedUnit(experts.alpha, 1.0, experts.limit, experts.interleaved)
        biases = {name: None if getattr(experts, name) is None else getattr(experts, name).detach().clone()
                  for name in ("gate_up_proj_bias", "down_proj_bias")}
        up = quantize(experts.gate_up_proj, gate_up_rows=rows)
        return QuantizedSwiGLUExperts(model_dim, experts.local_experts, up=up, down=quantize(experts.down_proj),
                                      up_bias=biases["gate_up_proj_bias"], down_bias=biases["down_proj_bias"],
                                      unit=unit, activations=activations)
