"""Routed experts with quantized weights at decoding sizes, on the CPU and CUDA: tutel's
``decode_quantized_experts`` operator.

``decode_quantized_experts(x, expert_ids, weights, format, gate_up, gate_up_scales, down, down_scales, ...)``
is the weighted sum of each token's routed experts,

    out[t] = sum_j weights[t, j] * (unit(x[t] @ Wgu[e]^T + gate_up_bias[e]) @ Wd[e]^T + down_bias[e]),
    e = expert_ids[t, j],

over the choices whose id lies in [0, E) (an id outside it, such as expert parallelism's -1 or
E, contributes nothing), where the experts' matrices Wgu [E, 2I or I, H] and Wd [E, O, I] are
held in one of three formats and decoded as they are read:

* ``"mxfp4"`` (OCP Microscaling v1.0): ``uint8 [E, N, K/2]`` codes, two E2M1 values a byte (the
  even element in the low nibble; values 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign) and
  ``[E, N, K/32]`` E8M0 scales (``uint8`` or ``float8_e8m0fnu``, value 2^(s-127)); K a multiple of 32.
* ``"nvfp4"``: the same codes, ``float8_e4m3fn [E, N, K/16]`` scales and a ``float32 [E]``
  scale per expert matrix (``gate_up_global``, ``down_global``): W = code * scale * global.
* ``"fp8_block"`` (DeepSeek-V3, Qwen3 FP8, transformers' FP8 experts): ``float8_e4m3fn [E, N, K]``
  values and ``[E, ceil(N/b0), ceil(K/b1)]`` scales (float32, bfloat16, float16 or
  float8_e8m0fnu) for ``block = (b0, b1)``: W[e, n, k] = q[e, n, k] * scale[e, n // b0, k // b1];
  the last blocks may be partial.

``unit`` is a ``tutel.ops.gated_units.GatedUnit`` (SwiGLU, or gpt-oss' clamped unit; gate_up
then holds 2I rows, the gates then the ups, or alternating when ``unit.interleaved``) or one of
``"gelu"``, ``"gelu_tanh"``, ``"relu"`` (gate_up holds I up rows, no gate).

Each routed expert's codes are streamed once per call, decoded in registers (on the CPU AVX-512 or
AVX2 with FMA and F16C where the CPU has them, portable loops otherwise, and for bfloat16 tokens
times MXFP4 codes AVX512-BF16's dot products, whose products are exact; on CUDA the kernels of
kernels/quantized_decode.cu, 16 bytes of codes a load), and the gate/up products, the unit, the
down products and the weighted sum run fused with float32 sums, in two parallel passes (the
gate/up pass leaves the units' values of every choice rounded to x's dtype, as the model's
experts and the prefill products keep them; the down pass adds each token's weighted rows).  On CUDA the two passes are two kernel launches with no host
synchronisation, so CUDA graphs capture the call; where those kernels fail the first-use self-check
on a device (tutel.ops.backend), the composite operator (tutel.ops.composite, one float32 product
per chosen expert after dequantizing it, which reads the chosen experts back to the host) runs
instead.  It is made for 1 to 32 tokens (any number is computed correctly); there is no backward:
it is for inference.
"""
from typing import Optional, Sequence, Tuple, Union

import torch

from .backend import operators_for
from .checks import require_dim, require_floating, require_tensor, same_device
from .kernel_sets import KernelSets
from .gated_units import SWIGLU, GatedUnit, check_unit, unit_scalars

FORMATS = ("mxfp4", "nvfp4", "fp8_block")
#: The units with up rows only (no gate), by name.
UP_ONLY_UNITS = ("gelu", "gelu_tanh", "relu")
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EXPERT_ID_DTYPES = (torch.int32, torch.int64)
#: fp8_block's scale block when none is given: DeepSeek-V3's and Qwen3 FP8's 128 x 128.
DEFAULT_FP8_BLOCK = (128, 128)

_E8M0 = getattr(torch, "float8_e8m0fnu", None)  # PyTorch 2.7 on
#: The device types with a kernel of the operator.
_DEVICES = ("cpu", "cuda")
_WHERE = "tutel.ops.decode_quantized_experts"


# The operator's kernel sets (tutel.ops.kernel_sets): which runs now, which this CPU runs, and the
# switch between them.
_KERNEL_SETS = KernelSets("quantized_decode")
quantized_decode_kernels = _KERNEL_SETS.current
quantized_decode_kernel_sets = _KERNEL_SETS.available
set_quantized_decode_kernels = _KERNEL_SETS.choose
using_quantized_decode_kernels = _KERNEL_SETS.using


def _shape(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(t.shape)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"{_WHERE}: {message}")


def _check_dtype(t: torch.Tensor, name: str, allowed: Sequence[torch.dtype], what: str) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{_WHERE}: `{name}` must be {what}, got {t.dtype}")


def _check_routing(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
    require_tensor(expert_ids, "expert_ids", _WHERE)
    _check_dtype(expert_ids, "expert_ids", EXPERT_ID_DTYPES, "int32 or int64")
    _require(expert_ids.dim() == 2 and expert_ids.shape[0] == x.shape[0],
             f"`expert_ids` must be [T, k] with T = {x.shape[0]} rows of `x`, got shape {_shape(expert_ids)}")
    same_device(x, expert_ids, "expert_ids", _WHERE)
    if weights is not None:
        require_floating(weights, "weights", _WHERE)
        _require(weights.shape == expert_ids.shape, f"`weights` must have the shape of `expert_ids` "
                 f"{_shape(expert_ids)}, got {_shape(weights)}")
        same_device(x, weights, "weights", _WHERE)


def _scales_for_kernel(format: str, scales: torch.Tensor, name: str) -> torch.Tensor:
    """The scales in a dtype the operator reads: E8M0 as its bytes (mxfp4) or as float32 (fp8_block)."""
    if format == "mxfp4":
        _check_dtype(scales, name, (torch.uint8,) + ((_E8M0,) if _E8M0 else ()), "uint8 or float8_e8m0fnu (E8M0)")
        return scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    if format == "nvfp4":
        _check_dtype(scales, name, (torch.float8_e4m3fn,), "float8_e4m3fn")
        return scales
    allowed = (torch.float32, torch.bfloat16, torch.float16) + ((_E8M0,) if _E8M0 else ())
    _check_dtype(scales, name, allowed, "float32, bfloat16, float16 or float8_e8m0fnu")
    return scales.float() if scales.dtype == _E8M0 else scales


def _check_stack(format: str, codes: torch.Tensor, scales: torch.Tensor, global_scale: Optional[torch.Tensor],
                 rows: int, cols: int, experts: int, block: Tuple[int, int], names: Tuple[str, str, str],
                 x: torch.Tensor) -> torch.Tensor:
    """Checks one stack [E, rows, cols] in `format`; returns its scales in the operator's dtype."""
    name, scales_name, global_name = names
    require_tensor(codes, name, _WHERE)
    require_tensor(scales, scales_name, _WHERE)
    same_device(x, codes, name, _WHERE)
    same_device(x, scales, scales_name, _WHERE)
    if format == "fp8_block":
        _check_dtype(codes, name, (torch.float8_e4m3fn,), "float8_e4m3fn (fp8_block)")
        want = (experts, rows, cols)
        want_scales = (experts, -(-rows // block[0]), -(-cols // block[1]))
    else:
        _check_dtype(codes, name, (torch.uint8,), f"uint8 ({format} codes, two a byte)")
        width = 32 if format == "mxfp4" else 16
        _require(cols % width == 0, f"{format} needs rows whose length is a multiple of {width}; `{name}`'s rows "
                 f"have {cols} elements")
        want = (experts, rows, cols // 2)
        want_scales = (experts, rows, cols // width)
    _require(_shape(codes) == want, f"`{name}` must be {list(want)} in {format}, got {list(_shape(codes))}")
    _require(_shape(scales) == want_scales, f"`{scales_name}` must be {list(want_scales)} for `{name}` "
             f"{list(want)} in {format}, got {list(_shape(scales))}")
    if format == "nvfp4":
        if global_scale is None:
            raise ValueError(f"{_WHERE}: nvfp4 needs `{global_name}`, each expert's float32 scale [{experts}]")
        require_tensor(global_scale, global_name, _WHERE)
        _check_dtype(global_scale, global_name, (torch.float32,), "float32")
        _require(_shape(global_scale) == (experts,), f"`{global_name}` must be [{experts}], got "
                 f"{list(_shape(global_scale))}")
        same_device(x, global_scale, global_name, _WHERE)
    elif global_scale is not None:
        raise ValueError(f"{_WHERE}: `{global_name}` is nvfp4's; {format} takes none")
    return _scales_for_kernel(format, scales, scales_name)


def _check_bias(bias: Optional[torch.Tensor], name: str, shape: Tuple[int, int],
                x: torch.Tensor) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    require_floating(bias, name, _WHERE)
    _require(_shape(bias) == shape, f"`{name}` must be {list(shape)}, got {list(_shape(bias))}")
    same_device(x, bias, name, _WHERE)
    return bias.float()


def _unit_arguments(unit: Union[GatedUnit, str]) -> tuple:
    """(activation, alpha, up_offset, limit, interleaved) as the operator takes them."""
    if isinstance(unit, GatedUnit):
        check_unit(unit, _WHERE)
        return ("gated",) + unit_scalars(unit) + (bool(unit.interleaved),)
    if isinstance(unit, str):
        if unit not in UP_ONLY_UNITS:
            raise ValueError(f"{_WHERE}: `unit` {unit!r} is not a unit; allowed: a GatedUnit or one of {UP_ONLY_UNITS}")
        return (unit, 1.0, 0.0, None, False)
    raise TypeError(f"{_WHERE}: `unit` must be a tutel.ops.gated_units.GatedUnit or one of {UP_ONLY_UNITS}, "
                    f"got {type(unit).__name__}")


def _fp8_block(format: str, block: Optional[Sequence[int]]) -> Tuple[int, int]:
    if format != "fp8_block":
        if block is not None:
            raise ValueError(f"{_WHERE}: `block` is fp8_block's; {format} has its own, got {block!r}")
        return (1, 1)
    if block is None:
        return DEFAULT_FP8_BLOCK
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(f"{_WHERE}: `block` must be (rows, cols), two integers >= 1, got {block!r}")
    return (int(block[0]), int(block[1]))


def decode_quantized_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: Optional[torch.Tensor],
                             format: str, gate_up: torch.Tensor, gate_up_scales: torch.Tensor,
                             down: torch.Tensor, down_scales: torch.Tensor, *,
                             gate_up_global: Optional[torch.Tensor] = None,
                             down_global: Optional[torch.Tensor] = None,
                             block: Optional[Sequence[int]] = None,
                             gate_up_bias: Optional[torch.Tensor] = None,
                             down_bias: Optional[torch.Tensor] = None,
                             unit: Union[GatedUnit, str] = SWIGLU) -> torch.Tensor:
    """The weighted sum of each token's routed experts with quantized weights, for inference on
    the CPU or a CUDA device (see the module docstring for the formula and the formats).

    Args:
        x: [T, H] token rows, float32, bfloat16 or float16, on the CPU or a CUDA device (every
            other tensor on the same device).
        expert_ids: [T, k] int32 or int64; an id outside [0, E) is a dropped choice.
        weights: [T, k] routing weights of any floating dtype (taken as float32), or None for 1.
        format: ``"mxfp4"``, ``"nvfp4"`` or ``"fp8_block"``.
        gate_up: the gate and up rows [E, 2I, H] (``GatedUnit``; concatenated or, with
            ``unit.interleaved``, alternating) or the up rows [E, I, H] (up-only units), as codes:
            uint8 [E, N, H/2] (fp4 formats) or float8_e4m3fn [E, N, H] (fp8_block).
        gate_up_scales: gate_up's scales (see the module docstring for each format's shape and dtype).
        down: the down rows [E, O, I] as codes (as gate_up).
        down_scales: down's scales.
        gate_up_global, down_global: nvfp4's float32 [E] scale per expert matrix (required for
            nvfp4, None otherwise).
        block: fp8_block's scale block (rows, cols); default (128, 128).  None for the fp4 formats.
        gate_up_bias: [E, 2I or I] bias laid out like gate_up's rows, or None.
        down_bias: [E, O], or None.  Biases of any floating dtype, taken as float32.
        unit: a ``GatedUnit`` (SwiGLU by default; gpt-oss' is
            ``GatedUnit(1.702, 1.0, 7.0, interleaved=True)``) or ``"gelu"``, ``"gelu_tanh"``, ``"relu"``.

    Returns:
        [T, O] in x's dtype.  Tokens without a kept choice give zeros.

    Raises:
        TypeError / ValueError: for a tensor of the wrong dtype, shape or device, naming it and
            the shape expected.
        RuntimeError: where a gradient would be needed: the operator has no backward.
    """
    require_tensor(x, "x", _WHERE)
    _check_dtype(x, "x", ACTIVATION_DTYPES, "float32, bfloat16 or float16")
    require_dim(x, 2, "x", _WHERE)
    if x.device.type not in _DEVICES:
        raise ValueError(f"{_WHERE}: runs on the CPU and CUDA devices, but `x` is on {x.device}")
    _check_routing(x, expert_ids, weights)
    if format not in FORMATS:
        raise ValueError(f"{_WHERE}: `format` must be one of {FORMATS}, got {format!r}")
    activation, alpha, up_offset, limit, interleaved = _unit_arguments(unit)
    fp8_block = _fp8_block(format, block)
    require_tensor(down, "down", _WHERE, min_dim=3)
    require_tensor(gate_up, "gate_up", _WHERE, min_dim=3)
    experts, outputs = gate_up.shape[0], down.shape[1]
    _require(down.shape[0] == experts, f"`gate_up` holds {experts} experts and `down` {down.shape[0]}; both must hold "
             "the same number")
    inter = down.shape[2] * (1 if format == "fp8_block" else 2)
    _require(experts >= 1 and x.shape[1] >= 1 and inter >= 1,
             f"`down` {list(_shape(down))} and `x` {list(_shape(x))} must hold at least one expert, feature and "
             "intermediate element")
    up_rows = 2 * inter if activation == "gated" else inter
    down_scales = _check_stack(format, down, down_scales, down_global, outputs, inter, experts, fp8_block,
                               ("down", "down_scales", "down_global"), x)
    gate_up_scales = _check_stack(format, gate_up, gate_up_scales, gate_up_global, up_rows, x.shape[1], experts,
                                  fp8_block, ("gate_up", "gate_up_scales", "gate_up_global"), x)
    gate_up_bias = _check_bias(gate_up_bias, "gate_up_bias", (experts, up_rows), x)
    down_bias = _check_bias(down_bias, "down_bias", (experts, outputs), x)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, weights, gate_up_bias, down_bias)):
        raise RuntimeError(f"{_WHERE} is for inference and has no backward, but an input requires a gradient: "
                           "call it under torch.no_grad() or torch.inference_mode()")
    # The compiled operator, or on a CUDA device whose kernels failed tutel.ops.backend's first-use
    # self-check, the composite one.
    return operators_for(x.device).decode_quantized_experts(
        x, expert_ids, weights, format, gate_up, gate_up_scales, gate_up_global, down, down_scales, down_global,
        list(fp8_block) if format == "fp8_block" else [], gate_up_bias, down_bias, activation, alpha, up_offset,
        limit, interleaved)


__all__ = ["DEFAULT_FP8_BLOCK", "FORMATS", "UP_ONLY_UNITS", "decode_quantized_experts", "quantized_decode_kernel_sets",
           "quantized_decode_kernels", "set_quantized_decode_kernels", "using_quantized_decode_kernels"]
