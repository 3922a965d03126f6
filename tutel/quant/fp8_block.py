"""Block-scaled FP8 expert weights ("fp8_block"): DeepSeek-V3's format, transformers' FP8Experts.

Codes q (E, N, K) in float8_e4m3fn and one scale per (b0 x b1) block,
``scale_inv`` (E, ceil(N / b0), ceil(K / b1)) in float32, bfloat16 or E8M0 ("ue8m0",
float8_e8m0fnu, powers of two):

    W[e, n, k] = q[e, n, k] * scale_inv[e, n // b0, k // b1]

The last block row and column may be partial (N or K no multiple of the block).  The block comes
from the checkpoint's ``weight_block_size`` (128 x 128 in DeepSeek-V3).  In transformers'
FP8Experts ``gate_up_proj`` is (E, 2I, H) with the gate rows first (``gate_up_rows="concatenated"``)
and ``down_proj`` is (E, H, I), each with its ``*_scale_inv``.  A fused gate/up matrix follows the
same rule over its 2I rows: where I is a multiple of b0 (DeepSeek-V3: I = 2048) its scale rows are
the gate's followed by the up projection's; where it is not, a checkpoint's separate gate and up
scale grids do not concatenate into this one (transformers then allocates at least two scale rows).
"""
import math
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from .base import GateUpRows, QuantizedWeights
from .checks import (require_dtype, require_finite, require_float_stack, require_ndim, require_none_where,
                     require_positive_int, require_same_device, require_shape, require_tensor)
from .codes import (E4M3_MAX, E8M0_BIAS, E8M0_NAN, FLOAT8_E8M0FNU, ceil_log2, decode_e4m3fn, decode_e8m0,
                    encode_e4m3fn, power_of_two)

SCALE_DTYPES: Tuple[torch.dtype, ...] = tuple(
    dtype for dtype in (torch.float32, torch.bfloat16, FLOAT8_E8M0FNU) if dtype is not None)


def block_of(block: object) -> Tuple[int, int]:
    """The (rows, columns) block a checkpoint's ``weight_block_size`` names, checked."""
    if isinstance(block, torch.Tensor) or not isinstance(block, Sequence) or len(block) != 2:
        raise ValueError(f"block={block!r} is not allowed; expected two integers > 0 (rows, columns), "
                         f"such as (128, 128)")
    return (require_positive_int("block[0]", block[0]), require_positive_int("block[1]", block[1]))


def scale_grid(out_features: int, in_features: int, block: Tuple[int, int]) -> Tuple[int, int]:
    """(ceil(N / b0), ceil(K / b1)): how many scale blocks cover an (N, K) matrix."""
    return (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))


class Fp8BlockWeights(QuantizedWeights):
    """E expert matrices (N, K) as float8_e4m3fn codes with one scale per (b0 x b1) block.

    Args:
        weight: (E, N, K) float8_e4m3fn codes.
        scale_inv: (E, ceil(N / b0), ceil(K / b1)) float32, bfloat16 or float8_e8m0fnu scales
            (the checkpoint's ``weight_scale_inv``: the factor that dequantizes); finite (E8M0:
            no byte 255).
        block: (b0, b1), the checkpoint's ``weight_block_size``.
        gate_up_rows: "concatenated" or "interleaved" for a fused gate/up matrix, else None.

    The tensors are kept as given (no copy)."""

    format = "fp8_block"

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, *, block: Sequence[int],
                 gate_up_rows: Union[GateUpRows, str, None] = None) -> None:
        weight = require_tensor("weight", weight)
        scale_inv = require_tensor("scale_inv", scale_inv)
        require_dtype("weight", weight, (torch.float8_e4m3fn,))
        require_ndim("weight", weight, 3, "(experts, out_features, in_features)")
        block = block_of(block)
        require_dtype("scale_inv", scale_inv, SCALE_DTYPES,
                      " (E8M0 exponents stored as uint8: pass scale_inv.view(torch.float8_e8m0fnu))")
        experts, rows, columns = weight.shape
        expected = (experts,) + scale_grid(rows, columns, block)
        require_shape("scale_inv", scale_inv, expected, "weight", weight.shape,
                      f" in blocks of {block}: (experts, ceil(out_features / {block[0]}), "
                      f"ceil(in_features / {block[1]}))")
        require_same_device(("weight", weight), ("scale_inv", scale_inv))
        if scale_inv.dtype == FLOAT8_E8M0FNU:
            require_none_where("scale_inv", scale_inv, scale_inv.view(torch.uint8) == E8M0_NAN, "E8M0 byte 255 (NaN)",
                               "E8M0 scales must be bytes 0..254")
        else:
            require_none_where("scale_inv", scale_inv, ~torch.isfinite(scale_inv), "a non-finite scale",
                               "scales must be finite")
        super().__init__({"weight": weight, "scale_inv": scale_inv}, rows, columns, gate_up_rows)
        self._block = block

    @property
    def weight(self) -> torch.Tensor:
        """(E, N, K) float8_e4m3fn codes."""
        return self._tensors["weight"]

    @property
    def scale_inv(self) -> torch.Tensor:
        """(E, ceil(N / b0), ceil(K / b1)) scales, in their checkpoint dtype."""
        return self._tensors["scale_inv"]

    @property
    def block(self) -> Tuple[int, int]:
        """(b0, b1): rows and columns of one scale block."""
        return self._block

    @property
    def scale_dtype(self) -> torch.dtype:
        """float32, bfloat16 or float8_e8m0fnu."""
        return self.scale_inv.dtype

    def metadata(self) -> Dict[str, Any]:
        """``block`` and ``gate_up_rows``, as the constructor takes them."""
        return {"block": self._block, **super().metadata()}

    def scales_float64(self) -> torch.Tensor:
        """The (E, ceil(N / b0), ceil(K / b1)) scales as float64 values (exact for every scale dtype)."""
        if self.scale_inv.dtype == FLOAT8_E8M0FNU:
            return decode_e8m0(self.scale_inv)
        return self.scale_inv.to(torch.float64)

    def dequantize_reference(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """W[e, n, k] = q[e, n, k] * scale_inv[e, n // b0, k // b1], in float64, rounded once to `dtype`."""
        rows, columns = self.out_features, self.in_features
        scales = self.scales_float64().repeat_interleave(self._block[0], dim=1)[:, :rows]
        scales = scales.repeat_interleave(self._block[1], dim=2)[:, :, :columns]
        return (decode_e4m3fn(self.weight) * scales).to(dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, *, block: Sequence[int] = (128, 128),
                 scale_dtype: Optional[torch.dtype] = torch.float32,
                 gate_up_rows: Union[GateUpRows, str, None] = None) -> "Fp8BlockWeights":
        """Quantize a floating (E, N, K) stack: each block's scale is amax / 448 (its largest
        magnitude lands on E4M3's largest), rounded to `scale_dtype` (float32, bfloat16, or
        float8_e8m0fnu rounded up to a power of two), and every element rounds to the nearest
        E4M3 code of value / scale (ties to even).  All-zero blocks get scale 1.  One expert is
        widened to float64 at a time."""
        weight = require_float_stack("weight", weight)
        block = block_of(block)
        if scale_dtype not in SCALE_DTYPES:
            names = ", ".join(str(dtype) for dtype in SCALE_DTYPES)
            raise ValueError(f"scale_dtype={scale_dtype} is not allowed; expected one of {names}")
        experts, rows, columns = weight.shape
        grid = scale_grid(rows, columns, block)
        codes = torch.empty((experts, rows, columns), dtype=torch.float8_e4m3fn, device=weight.device)
        scales = torch.empty((experts,) + grid, dtype=scale_dtype, device=weight.device)
        for expert in range(experts):
            require_finite("weight", weight[expert], expert)
            matrix = weight[expert].to(torch.float64)
            padded = matrix.new_zeros((grid[0] * block[0], grid[1] * block[1]))
            padded[:rows, :columns] = matrix.abs()
            amax = padded.view(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3))
            scales[expert], value = _block_scales(amax, scale_dtype, expert)
            value = value.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :columns]
            codes[expert] = encode_e4m3fn(matrix / value)
        return cls(codes, scales, block=block, gate_up_rows=gate_up_rows)


def _block_scales(amax: torch.Tensor, scale_dtype: torch.dtype, expert: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(stored scales in `scale_dtype`, their float64 values) for float64 block maxima `amax`."""
    if scale_dtype == FLOAT8_E8M0FNU:
        # the smallest power of two 2^k with amax / 2^k <= 448; ceil_log2 of the rounded quotient can
        # fall one short when amax / 448 rounds down onto a power of two, which the comparison fixes
        exponent = ceil_log2(amax / E4M3_MAX).clamp(-E8M0_BIAS, E8M0_BIAS + 1)
        exponent = torch.where(amax > E4M3_MAX * power_of_two(exponent), exponent + 1, exponent)
        exponent = torch.where(amax == 0, torch.zeros_like(exponent), exponent)
        if exponent.numel() and int(exponent.max()) > E8M0_BIAS:
            raise ValueError(f"weight: expert {expert}'s largest magnitude {float(amax.max())} needs a scale above "
                             f"2^{E8M0_BIAS}, the largest E8M0 scale")
        stored = (exponent + E8M0_BIAS).to(torch.uint8).view(FLOAT8_E8M0FNU)
        return stored, power_of_two(exponent)
    info = torch.finfo(scale_dtype)
    # a scale that would round to zero is raised to the dtype's smallest normal number: the block's
    # codes then stay within E4M3's range
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX).clamp(min=info.tiny)
    stored = scale.to(scale_dtype)
    if not bool(torch.isfinite(stored).all()):
        raise ValueError(f"weight: expert {expert}'s largest magnitude {float(amax.max())} needs a scale beyond "
                         f"{scale_dtype}'s range")
    return stored, stored.to(torch.float64)
