"""NVFP4 expert weights: E2M1 elements, an E4M3 scale per 16 and a float32 scale per matrix.

    W[e, n, k] = E2M1(code[e, n, k]) * block_scales[e, n, k // 16] * global_scales[e]

Two codes per byte, element 2j in the low nibble of byte j.  ModelOpt stores each expert's matrix
as ``weight`` (N, K / 2) uint8, ``weight_scale`` (N, K / 16) float8_e4m3fn and ``weight_scale_2``
(a float32 scalar); the stack holds them with the experts first (``from_modelopt`` stacks the
per-expert tensors).
"""
from typing import Sequence, Union

import torch

from .base import GateUpRows, QuantizedWeights
from .checks import (require_dtype, require_finite, require_float_stack, require_multiple, require_ndim,
                     require_none_where, require_same_device, require_shape, require_tensor)
from .codes import (E2M1_MAX, E4M3_MAX, FLOAT4_E2M1FN_X2, decode_e2m1, decode_e4m3fn, e4m3fn_nan, encode_e2m1,
                    encode_e4m3fn, pack_e2m1, unpack_e2m1)

NV_BLOCK = 16
PACKED_DTYPES = tuple(dtype for dtype in (torch.uint8, torch.int8, FLOAT4_E2M1FN_X2) if dtype is not None)
# float32's smallest normal number: the least global scale the quantizer stores, so tiny matrices
# do not divide by a global scale flushed to zero
_SMALLEST_GLOBAL_SCALE = torch.finfo(torch.float32).tiny


class Nvfp4Weights(QuantizedWeights):
    """E expert matrices (N, K) as NVFP4: packed E2M1 codes, an E4M3 scale per 16 elements of K and
    one float32 scale per expert's matrix.

    Args:
        packed: (E, N, K / 2) bytes; uint8, int8 or float4_e2m1fn_x2 (kept as uint8).  K must be a
            multiple of 16.
        block_scales: (E, N, K / 16) float8_e4m3fn (ModelOpt's ``weight_scale``), no NaN.
        global_scales: (E,) float32 (ModelOpt's ``weight_scale_2`` of each expert), finite.
        gate_up_rows: "concatenated", "interleaved" or None.

    The tensors are kept as given (the packed bytes viewed as uint8)."""

    format = "nvfp4"

    def __init__(self, packed: torch.Tensor, block_scales: torch.Tensor, global_scales: torch.Tensor, *,
                 gate_up_rows: Union[GateUpRows, str, None] = None) -> None:
        packed = require_tensor("packed", packed)
        block_scales = require_tensor("block_scales", block_scales)
        global_scales = require_tensor("global_scales", global_scales)
        require_dtype("packed", packed, PACKED_DTYPES)
        require_ndim("packed", packed, 3, "(experts, out_features, in_features / 2) bytes")
        given_shape = tuple(packed.shape)
        packed = packed.view(torch.uint8)
        experts, rows, columns = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
        require_multiple("packed", packed, "in_features (2 per byte)", columns, NV_BLOCK,
                         f"one E4M3 scale per {NV_BLOCK} elements")
        require_dtype("block_scales", block_scales, (torch.float8_e4m3fn,))
        require_shape("block_scales", block_scales, (experts, rows, columns // NV_BLOCK), "packed", given_shape,
                      f": (experts, out_features, in_features / {NV_BLOCK})")
        require_dtype("global_scales", global_scales, (torch.float32,))
        require_shape("global_scales", global_scales, (experts,), "packed", given_shape,
                      ": one scale per expert")
        require_same_device(("packed", packed), ("block_scales", block_scales), ("global_scales", global_scales))
        require_none_where("block_scales", block_scales, e4m3fn_nan(block_scales), "E4M3 NaN",
                           "scales must be finite")
        require_none_where("global_scales", global_scales, ~torch.isfinite(global_scales), "a non-finite scale",
                           "scales must be finite")
        super().__init__({"packed": packed, "block_scales": block_scales, "global_scales": global_scales},
                         rows, columns, gate_up_rows)

    @property
    def packed(self) -> torch.Tensor:
        """(E, N, K / 2) uint8: two E2M1 codes per byte, the even element in the low nibble."""
        return self._tensors["packed"]

    @property
    def block_scales(self) -> torch.Tensor:
        """(E, N, K / 16) float8_e4m3fn: one scale per 16 elements of a row."""
        return self._tensors["block_scales"]

    @property
    def global_scales(self) -> torch.Tensor:
        """(E,) float32: each expert's matrix scale."""
        return self._tensors["global_scales"]

    def dequantize_reference(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """W[e, n, k] = E2M1(code) * block_scales[e, n, k // 16] * global_scales[e], in float64 (exact),
        rounded once to `dtype`."""
        values = decode_e2m1(unpack_e2m1(self.packed))
        block = decode_e4m3fn(self.block_scales).repeat_interleave(NV_BLOCK, dim=2)
        return (values * block * self.global_scales.to(torch.float64)[:, None, None]).to(dtype)

    @classmethod
    def from_modelopt(cls, weight: Sequence[torch.Tensor], weight_scale: Sequence[torch.Tensor],
                      weight_scale_2: Sequence[torch.Tensor], *,
                      gate_up_rows: Union[GateUpRows, str, None] = None) -> "Nvfp4Weights":
        """Stack ModelOpt's per-expert tensors (one entry per expert, at least one): ``weight`` (N, K / 2),
        ``weight_scale`` (N, K / 16) and the scalar ``weight_scale_2``.  Copies them."""
        lists = {"weight": list(weight), "weight_scale": list(weight_scale), "weight_scale_2": list(weight_scale_2)}
        if not lists["weight"]:
            raise ValueError("weight: an empty sequence; expected one tensor per expert (at least one)")
        for name, tensors in lists.items():
            if len(tensors) != len(lists["weight"]):
                raise ValueError(f"{name}: {len(tensors)} tensors but weight has {len(lists['weight'])}; "
                                 f"expected one per expert")
            first = require_tensor(f"{name}[0]", tensors[0])
            if name == "weight_scale_2" and first.numel() != 1:
                raise ValueError(f"weight_scale_2[0]: shape {tuple(first.shape)}; expected a scalar (one element)")
            for index, tensor in enumerate(tensors):
                tensor = require_tensor(f"{name}[{index}]", tensor)
                require_dtype(f"{name}[{index}]", tensor, (first.dtype,), f" (the dtype of {name}[0])")
                require_shape(f"{name}[{index}]", tensor, tuple(first.shape), f"{name}[0]", first.shape)
        packed = torch.stack(lists["weight"])
        block_scales = torch.stack(lists["weight_scale"])
        global_scales = torch.stack([scale.reshape(()) for scale in lists["weight_scale_2"]])
        return cls(packed, block_scales, global_scales, gate_up_rows=gate_up_rows)

    @classmethod
    def quantize(cls, weight: torch.Tensor, *,
                 gate_up_rows: Union[GateUpRows, str, None] = None) -> "Nvfp4Weights":
        """Quantize a floating (E, N, K) stack (K a multiple of 16): each expert's global scale is
        amax / (6 * 448) in float32 (1 for an all-zero matrix), each 16-block's scale is its
        amax / 6 relative to it, rounded to E4M3 (ties to even), and each element rounds to the
        nearest E2M1 value of value / (block scale * global scale), ties to even, saturating at +-6
        (blocks whose scale rounds to zero become zeros).  One expert is widened to float64 at a time.

        Quantizing the dequantized result again gives it back exactly while every block scale is an
        E4M3 normal number (block amax at least 2^-6 / 448 of the matrix's); a block scale rounded to
        a subnormal can leave the block's largest code below 6, and a second pass then picks another
        scale."""
        weight = require_float_stack("weight", weight)
        experts, rows, columns = weight.shape
        require_multiple("weight", weight, "in_features", columns, NV_BLOCK, f"one E4M3 scale per {NV_BLOCK} elements")
        groups = columns // NV_BLOCK
        packed = torch.empty((experts, rows, columns // 2), dtype=torch.uint8, device=weight.device)
        block_scales = torch.empty((experts, rows, groups), dtype=torch.float8_e4m3fn, device=weight.device)
        global_scales = torch.empty((experts,), dtype=torch.float32, device=weight.device)
        for expert in range(experts):
            require_finite("weight", weight[expert], expert)
            matrix = weight[expert].to(torch.float64)
            amax = float(matrix.abs().max()) if matrix.numel() else 0.0
            stored_global = torch.tensor(max(amax / (E2M1_MAX * E4M3_MAX), _SMALLEST_GLOBAL_SCALE) if amax else 1.0,
                                         dtype=torch.float64).to(torch.float32)
            if not bool(torch.isfinite(stored_global)):
                raise ValueError(f"weight: expert {expert}'s largest magnitude {amax} needs a global scale beyond "
                                 f"float32's range")
            global_scale = float(stored_global)
            blocks = matrix.view(rows, groups, NV_BLOCK)
            stored_blocks = encode_e4m3fn(blocks.abs().amax(dim=-1) / (E2M1_MAX * global_scale))
            step = decode_e4m3fn(stored_blocks).unsqueeze(-1) * global_scale
            scaled = torch.where(step > 0, blocks / torch.where(step > 0, step, 1.0), 0.0)
            packed[expert] = pack_e2m1(encode_e2m1(scaled).view(rows, columns))
            block_scales[expert] = stored_blocks
            global_scales[expert] = stored_global
        return cls(packed, block_scales, global_scales, gate_up_rows=gate_up_rows)
