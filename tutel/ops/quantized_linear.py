"""Rows grouped by expert times a quantized expert stack, on the CPU or a CUDA device: tutel's
``quantized_grouped_linear`` operator, the prefill products of quantized experts.

``quantized_grouped_linear(rows, ends, stack, bias, activation_group=0)`` is, for the rows of
each expert e (``rows[ends[e-1]:ends[e]]``, the rows past the last end giving zeros),

    y[r] = rows[r] @ W[e]^T + bias[e]

with W the ``tutel.quant`` stack (``Fp8BlockWeights``, ``Mxfp4Weights``, ``Nvfp4Weights``)
dequantized as its format defines it, summed in float32.  With ``activation_group`` g > 0 (W8A8,
block-FP8 stacks; g a multiple of 16 or at least K, usually the block's width b1) each row is
first quantized per group of g columns (the last may be partial) to E4M3 with the float32 scale
amax / 448, codes = E4M3 rounding (ties to even) of value / max(scale, 1e-12), and multiplied as
codes * scale: ``tutel.quant.activations.dynamic_activations``' rule, bit for bit on the CPU
(which quantizes into a float32 buffer and takes the float32 products below, whatever the rows'
dtype); CUDA quantizes inside its one launch.

On the CPU no float copy of a matrix is ever made:
each work item (an expert and a strip of its outputs) decodes its strip into a small buffer of its
thread, laid out as the multiplying kernel reads it, and multiplies all of the expert's rows with it.

* float32 and float16 rows: the strips are decoded exactly in float32 (nvfp4's two scales
  multiplied in float32 first) and multiplied with AVX-512 FMA loops (portable loops on other
  CPUs); float16 rows are widened to float32 and the results rounded back.
* bfloat16 rows, where the CPU has AMX (Intel Xeon from Sapphire Rapids on; kernel set "amx"): the
  strips are decoded into bfloat16 tiles, **each weight rounded to bfloat16** (as transformers' CPU
  path dequantizes FP8 weights to bfloat16; MXFP4 values are exact in bfloat16 unless tiny), and
  multiplied on AMX tiles.
* bfloat16 rows where the CPU has AVX512-BF16 and VBMI but not AMX (AMD Zen 4 on; kernel set
  "avx512_bf16"): strips of 256 outputs are decoded exactly and each weight rounded to bfloat16 as
  on AMX, and PyTorch's bfloat16 GEMM (float32 sums, one thread per strip) multiplies the expert's
  rows with them; a bias enters those float32 sums as three bfloat16 parts against columns of ones.
  On other CPUs bfloat16 rows take the float32 way above.

On CUDA the operator is one launch on the tensor cores (csrc/ops/cuda): each block decodes a tile
of codes into shared memory; 16-bit rows are multiplied as they are, float32 rows as three bfloat16
parts.  There the ends stay on the device (their values are never read back, so they are not
checked: the kernel reads their running maximum clamped to [0, n]).

Inference only: there is no backward.
"""
from typing import Optional, Sequence, Union

import torch

from ..quant import Fp8BlockWeights, Mxfp4Weights, Nvfp4Weights, QuantizedWeights
from .checks import require_dim, require_floating, require_tensor, same_device
from .kernel_sets import KernelSets

ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
END_DTYPES = (torch.int32, torch.int64)

_E8M0 = getattr(torch, "float8_e8m0fnu", None)  # PyTorch 2.7 on
_WHERE = "tutel.ops.quantized_grouped_linear"


# The operator's kernel sets (tutel.ops.kernel_sets): which runs now, which this CPU runs, and the
# switch between them.
_KERNEL_SETS = KernelSets("quantized_linear")
quantized_linear_kernels = _KERNEL_SETS.current
quantized_linear_kernel_sets = _KERNEL_SETS.available
set_quantized_linear_kernels = _KERNEL_SETS.choose
using_quantized_linear_kernels = _KERNEL_SETS.using


def stack_arguments(stack: QuantizedWeights) -> tuple:
    """(format, codes, scales, global_scale, block) as the operator takes them."""
    if isinstance(stack, Mxfp4Weights):
        return "mxfp4", stack.packed, stack.scales, None, []
    if isinstance(stack, Nvfp4Weights):
        return "nvfp4", stack.packed, stack.block_scales, stack.global_scales, []
    if isinstance(stack, Fp8BlockWeights):
        scales = stack.scale_inv
        if _E8M0 is not None and scales.dtype == _E8M0:  # powers of two: exact in float32
            scales = scales.float()
        return "fp8_block", stack.weight, scales, None, list(stack.block)
    raise TypeError(f"{_WHERE}: `stack` must be a tutel.quant Fp8BlockWeights, Mxfp4Weights or Nvfp4Weights, "
                    f"got {type(stack).__name__}")


def _checked_ends(ends: Union[torch.Tensor, Sequence[int]], experts: int, rows: torch.Tensor) -> torch.Tensor:
    """The ends as a tensor on the rows' device, their dtype, shape and device checked; on the CPU
    their values too (on CUDA that would read them back to the host)."""
    if not isinstance(ends, torch.Tensor):
        if not isinstance(ends, (list, tuple)) or not all(isinstance(e, int) and not isinstance(e, bool)
                                                          for e in ends):
            raise TypeError(f"{_WHERE}: `ends` must be an int32 / int64 tensor or a sequence of ints, "
                            f"got {type(ends).__name__}")
        ends = torch.tensor(list(ends), dtype=torch.int64 if rows.device.type == "cpu" else torch.int32,
                            device=rows.device)
    if ends.dtype not in END_DTYPES:
        raise TypeError(f"{_WHERE}: `ends` must be int32 or int64, got {ends.dtype}")
    if tuple(ends.shape) != (experts,):
        raise ValueError(f"{_WHERE}: `ends` must be [{experts}], one end per expert of `stack`, got shape "
                         f"{list(ends.shape)}")
    same_device(rows, ends, "ends", _WHERE)
    if rows.device.type == "cpu" and experts and \
            ((ends[0] < 0) | (ends[-1] > rows.shape[0]) | (ends[1:] < ends[:-1]).any()).item():
        raise ValueError(f"{_WHERE}: `ends` must be non-decreasing within [0, {rows.shape[0]}] (the rows of "
                         f"`rows`), got {ends.tolist()}")
    return ends


def _check_activation_group(group: object, format: str, features: int) -> None:
    """TypeError / ValueError unless `group` is 0 or, for fp8_block, a multiple of 16 or at least K."""
    if not isinstance(group, int) or isinstance(group, bool):
        raise TypeError(f"{_WHERE}: `activation_group` must be an int, got {type(group).__name__}")
    if group < 0:
        raise ValueError(f"{_WHERE}: `activation_group` must be 0 (weight-only) or a positive group width, got "
                         f"{group}")
    if group and format != "fp8_block":
        raise ValueError(f"{_WHERE}: `activation_group` = {group} (W8A8 activations) needs an Fp8BlockWeights "
                         f"stack, got {format}")
    if group and group % 16 and group < features:
        raise ValueError(f"{_WHERE}: `activation_group` must be a multiple of 16 or at least K = {features} (one "
                         f"group a row), got {group}")


def quantized_grouped_linear(rows: torch.Tensor, ends: Union[torch.Tensor, Sequence[int]], stack: QuantizedWeights,
                             bias: Optional[torch.Tensor] = None, activation_group: int = 0) -> torch.Tensor:
    """The products of rows grouped by expert with a quantized stack, for inference on the CPU or a
    CUDA device (see the module docstring for the rounding of each dtype).

    Args:
        rows: [n, K] rows, float32, bfloat16 or float16, on the CPU or a CUDA device; expert e's
            are rows[ends[e-1]:ends[e]] (ends[-1] = 0).
        ends: [E] non-decreasing end of each expert's rows, within [0, n]: an int32 / int64
            tensor on the rows' device or a sequence of ints.  Rows past the last end give zeros.
            On CUDA their values are not checked (that would read them back to the host).
        stack: a tutel.quant stack of E matrices [N, K] (``Fp8BlockWeights``, ``Mxfp4Weights``,
            ``Nvfp4Weights``) on the rows' device.
        bias: [E, N] of any floating dtype (taken as float32), or None.
        activation_group: 0 (the rows as they are), or W8A8's group width g (``Fp8BlockWeights``
            only; a multiple of 16 or at least K): the rows quantized per group of g columns first
            (see the module docstring).

    Returns:
        [n, N] in rows' dtype.

    Raises:
        TypeError: `stack` is no tutel.quant stack, or a tensor has a dtype not allowed (named).
        ValueError: a shape or device that does not fit (named, with the shape expected).
        RuntimeError: where a gradient would be needed: the operator has no backward.
    """
    require_tensor(rows, "rows", _WHERE)
    if rows.dtype not in ROW_DTYPES:
        raise TypeError(f"{_WHERE}: `rows` must be float32, bfloat16 or float16, got {rows.dtype}")
    require_dim(rows, 2, "rows", _WHERE)
    if rows.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{_WHERE}: runs on the CPU and CUDA devices, but `rows` is on {rows.device}")
    format, codes, scales, global_scale, block = stack_arguments(stack)
    if stack.device != rows.device:
        raise ValueError(f"{_WHERE}: `stack` is on {stack.device} but `rows` on {rows.device}; they must lie on "
                         f"one device")
    experts, outputs, features = stack.shape
    if rows.shape[1] != features:
        raise ValueError(f"{_WHERE}: `rows` {list(rows.shape)} must have the {features} features of `stack` "
                         f"{list(stack.shape)} (experts, out_features, in_features)")
    ends = _checked_ends(ends, experts, rows)
    _check_activation_group(activation_group, format, features)
    if bias is not None:
        require_floating(bias, "bias", _WHERE)
        if tuple(bias.shape) != (experts, outputs):
            raise ValueError(f"{_WHERE}: `bias` must be [{experts}, {outputs}], got {list(bias.shape)}")
        same_device(rows, bias, "bias", _WHERE)
    if torch.is_grad_enabled() and (rows.requires_grad or (bias is not None and bias.requires_grad)):
        raise RuntimeError(f"{_WHERE} is for inference and has no backward, but an input requires a gradient: "
                           "call it under torch.no_grad() or torch.inference_mode()")
    return torch.ops.tutel.quantized_grouped_linear(rows, ends, format, codes, scales, global_scale, block, bias,
                                                    activation_group)


__all__ = ["quantized_grouped_linear", "quantized_linear_kernel_sets", "quantized_linear_kernels",
           "set_quantized_linear_kernels", "using_quantized_linear_kernels"]
