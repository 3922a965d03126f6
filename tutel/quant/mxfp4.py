"""MXFP4 expert weights (OCP Microscaling v1.0): E2M1 elements sharing one E8M0 scale per 32.

    W[e, n, k] = E2M1(code[e, n, k]) * 2^(scales[e, n, k // 32] - 127)

Two codes per byte, element 2j in the low nibble of byte j.  gpt-oss' checkpoint stores
``*_blocks`` (E, N, K / 32, 16) uint8 with ``*_scales`` (E, N, K / 32) uint8; transformers'
Mxfp4GptOssExperts holds the same bytes as (E, N, K / 2).  Both are accepted; the stack keeps
(E, N, K / 2) bytes and (E, N, K / 32) scale bytes.  gpt-oss' ``gate_up_proj`` interleaves its rows
(even rows gate, odd rows up): ``gate_up_rows="interleaved"``.
"""
from typing import Union

import torch

from .base import GateUpRows, QuantizedWeights
from .checks import (require_dtype, require_finite, require_float_stack, require_multiple, require_ndim,
                     require_none_where, require_same_device, require_shape, require_tensor, shape_text)
from .codes import (E8M0_BIAS, E8M0_NAN, FLOAT4_E2M1FN_X2, FLOAT8_E8M0FNU, decode_e2m1, decode_e8m0,
                    encode_e2m1, floor_log2, pack_e2m1, power_of_two, unpack_e2m1)

MX_BLOCK = 32
# E2M1's largest exponent (6 = 1.5 * 2^2): OCP MX's shared exponent is floor(log2(amax)) minus it
E2M1_EMAX = 2
PACKED_DTYPES = tuple(dtype for dtype in (torch.uint8, torch.int8, FLOAT4_E2M1FN_X2) if dtype is not None)
E8M0_DTYPES = tuple(dtype for dtype in (torch.uint8, FLOAT8_E8M0FNU) if dtype is not None)


class Mxfp4Weights(QuantizedWeights):
    """E expert matrices (N, K) as MXFP4: packed E2M1 codes and one E8M0 scale per 32 elements of K.

    Args:
        packed: (E, N, K / 2) bytes, or gpt-oss' blocks (E, N, K / 32, 16); uint8, int8 or
            float4_e2m1fn_x2 (kept as uint8).  K must be a multiple of 32.
        scales: (E, N, K / 32) E8M0 exponents, uint8 or float8_e8m0fnu (kept as uint8); byte 255
            (NaN) is rejected.
        gate_up_rows: "interleaved" (gpt-oss), "concatenated" or None.

    The tensors are kept as given, viewed as uint8 (gpt-oss' blocks reshaped: a copy only when
    they are not contiguous)."""

    format = "mxfp4"

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, *,
                 gate_up_rows: Union[GateUpRows, str, None] = None) -> None:
        packed = require_tensor("packed", packed)
        scales = require_tensor("scales", scales)
        require_dtype("packed", packed, PACKED_DTYPES)
        given_shape = tuple(packed.shape)
        if packed.dim() == 4:
            if packed.shape[-1] != MX_BLOCK // 2:
                raise ValueError(f"packed: shape {shape_text(given_shape)} is 4-D but its last dimension is not "
                                 f"{MX_BLOCK // 2}; gpt-oss' blocks are (experts, out_features, in_features / "
                                 f"{MX_BLOCK}, {MX_BLOCK // 2})")
            packed = packed.reshape(packed.shape[0], packed.shape[1], -1)
        require_ndim("packed", packed, 3, f"(experts, out_features, in_features / 2) bytes, or gpt-oss' blocks "
                                          f"(experts, out_features, in_features / {MX_BLOCK}, {MX_BLOCK // 2})")
        packed = packed.view(torch.uint8)
        experts, rows, columns = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
        require_multiple("packed", packed, "in_features (2 per byte)", columns, MX_BLOCK,
                         f"one E8M0 scale per {MX_BLOCK} elements")
        require_dtype("scales", scales, E8M0_DTYPES)
        require_shape("scales", scales, (experts, rows, columns // MX_BLOCK), "packed", given_shape,
                      f": (experts, out_features, in_features / {MX_BLOCK})")
        scales = scales.view(torch.uint8)
        require_same_device(("packed", packed), ("scales", scales))
        require_none_where("scales", scales, scales == E8M0_NAN, "E8M0 byte 255 (NaN)",
                           "E8M0 scales must be bytes 0..254")
        super().__init__({"packed": packed, "scales": scales}, rows, columns, gate_up_rows)

    @property
    def packed(self) -> torch.Tensor:
        """(E, N, K / 2) uint8: two E2M1 codes per byte, the even element in the low nibble."""
        return self._tensors["packed"]

    @property
    def scales(self) -> torch.Tensor:
        """(E, N, K / 32) uint8 E8M0 exponents: scale 2^(byte - 127)."""
        return self._tensors["scales"]

    def gpt_oss_blocks(self) -> torch.Tensor:
        """The packed bytes in gpt-oss' checkpoint layout (E, N, K / 32, 16) (a view)."""
        return self.packed.view(self.experts, self.out_features, self.in_features // MX_BLOCK, MX_BLOCK // 2)

    def dequantize_reference(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """W[e, n, k] = E2M1(code) * 2^(scale - 127), in float64 (exact), rounded once to `dtype`."""
        values = decode_e2m1(unpack_e2m1(self.packed))
        return (values * decode_e8m0(self.scales).repeat_interleave(MX_BLOCK, dim=2)).to(dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, *,
                 gate_up_rows: Union[GateUpRows, str, None] = None) -> "Mxfp4Weights":
        """Quantize a floating (E, N, K) stack (K a multiple of 32) as OCP MX v1.0 suggests: each
        32-block's shared exponent is floor(log2(amax)) - 2 (2: E2M1's largest exponent), clamped to
        E8M0's [-127, 127], and each element rounds to the nearest E2M1 value of value / 2^exponent,
        ties to even, saturating at +-6.  All-zero blocks get exponent 0.  One expert is widened to
        float64 at a time."""
        weight = require_float_stack("weight", weight)
        experts, rows, columns = weight.shape
        require_multiple("weight", weight, "in_features", columns, MX_BLOCK, f"one E8M0 scale per {MX_BLOCK} elements")
        groups = columns // MX_BLOCK
        packed = torch.empty((experts, rows, columns // 2), dtype=torch.uint8, device=weight.device)
        scales = torch.empty((experts, rows, groups), dtype=torch.uint8, device=weight.device)
        for expert in range(experts):
            require_finite("weight", weight[expert], expert)
            matrix = weight[expert].to(torch.float64)
            blocks = matrix.view(rows, groups, MX_BLOCK)
            amax = blocks.abs().amax(dim=-1)
            exponent = torch.where(amax == 0, 0, floor_log2(amax) - E2M1_EMAX).clamp(min=-E8M0_BIAS)
            if exponent.numel() and int(exponent.max()) > E8M0_BIAS:
                raise ValueError(f"weight: expert {expert}'s largest magnitude {float(amax.max())} needs a shared "
                                 f"exponent above {E8M0_BIAS}, the largest E8M0 scale")
            codes = encode_e2m1(blocks / power_of_two(exponent).unsqueeze(-1))
            packed[expert] = pack_e2m1(codes.view(rows, columns))
            scales[expert] = (exponent + E8M0_BIAS).to(torch.uint8)
        return cls(packed, scales, gate_up_rows=gate_up_rows)
