"""The quantized formats as their specifications state them, one element at a time in plain Python:
the decoders and quantizers the tests of tutel.quant compare with (slow: tiny tensors only), and
builders of random valid checkpoint tensors.

Written from the format definitions (OCP MX v1.0 for E2M1 / E8M0, OCP FP8 for E4M3, DeepSeek-V3's
block rule, NVFP4's two-level scale), independently of tutel.quant.codes.
"""
import math
import struct
from typing import List, Optional, Sequence, Tuple

import torch

E2M1_POSITIVE_CODES = range(8)


def e2m1_value(code: int) -> float:
    """S EE M: exponent bias 1; exponent 0 is subnormal (m / 2); no infinity or NaN."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    if exponent == 0:
        return sign * mantissa / 2
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def e4m3fn_value(byte: int) -> float:
    """S EEEE MMM: exponent bias 7; exponent 0 is subnormal (2^-6 * m / 8); S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0b111
    if exponent == 0xF and mantissa == 0b111:
        return math.nan
    if exponent == 0:
        return sign * 2.0 ** -6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


def e8m0_value(byte: int) -> float:
    """2^(byte - 127); 255 is NaN."""
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def nibble(byte: int, element: int) -> int:
    """The E2M1 code of `element` in its byte: the even element in the low nibble."""
    return byte & 0xF if element % 2 == 0 else byte >> 4


def to_float32(value: float) -> float:
    """`value` rounded to float32 (C's conversion: to nearest)."""
    return struct.unpack("f", struct.pack("f", value))[0]


# -- decoders ---------------------------------------------------------------------------------------

def decode_fp8_block(weight: torch.Tensor, scale_values: List, block: Tuple[int, int]) -> torch.Tensor:
    """W[e, n, k] = e4m3(q[e, n, k]) * s[e][n // b0][k // b1] (`scale_values` as Python floats)."""
    codes = weight.view(torch.uint8).tolist()
    out = [[[e4m3fn_value(codes[e][n][k]) * scale_values[e][n // block[0]][k // block[1]]
             for k in range(weight.shape[2])] for n in range(weight.shape[1])] for e in range(weight.shape[0])]
    return torch.tensor(out, dtype=torch.float64).reshape(weight.shape)


def decode_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W[e, n, k] = e2m1(code) * 2^(scales[e, n, k // 32] - 127) from (E, N, K / 2) bytes."""
    data, exps = packed.tolist(), scales.tolist()
    experts, rows, columns = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    out = [[[e2m1_value(nibble(data[e][n][k // 2], k)) * e8m0_value(exps[e][n][k // 32])
             for k in range(columns)] for n in range(rows)] for e in range(experts)]
    return torch.tensor(out, dtype=torch.float64).reshape(experts, rows, columns)


def decode_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scales: torch.Tensor) -> torch.Tensor:
    """W[e, n, k] = e2m1(code) * e4m3(block_scales[e, n, k // 16]) * global_scales[e]."""
    data, scales, globals_ = packed.tolist(), block_scales.view(torch.uint8).tolist(), global_scales.tolist()
    experts, rows, columns = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    out = [[[e2m1_value(nibble(data[e][n][k // 2], k)) * e4m3fn_value(scales[e][n][k // 16]) * globals_[e]
             for k in range(columns)] for n in range(rows)] for e in range(experts)]
    return torch.tensor(out, dtype=torch.float64).reshape(experts, rows, columns)


# -- quantizers -------------------------------------------------------------------------------------

def _nearest(magnitude: float, candidates: Sequence[Tuple[int, float]]) -> int:
    """The code of the candidate value nearest to `magnitude`; a tie goes to the even code."""
    best = min(candidates, key=lambda item: (abs(item[1] - magnitude), item[0] % 2))
    return best[0]


_E2M1 = [(code, e2m1_value(code)) for code in E2M1_POSITIVE_CODES]
_E4M3 = [(code, e4m3fn_value(code)) for code in range(0x7F)]


def nearest_e2m1(value: float) -> int:
    """E2M1 code of `value`: nearest, ties to even, saturating at 6; bit 3 carries the sign."""
    code = 7 if abs(value) >= 6 else _nearest(abs(value), _E2M1)
    return code | (8 if math.copysign(1.0, value) < 0 else 0)


def nearest_e4m3(value: float) -> int:
    """E4M3 byte of `value`: nearest, ties to even, saturating at 448; bit 7 carries the sign."""
    code = 0x7E if abs(value) >= 448 else _nearest(abs(value), _E4M3)
    return code | (0x80 if math.copysign(1.0, value) < 0 else 0)


def blocks_of(matrix: List[List[float]], rows: int, columns: int):
    """(block row, block column, [values]) of a nested list in (rows x columns) blocks, partial ones too."""
    for top in range(0, len(matrix), rows):
        for left in range(0, len(matrix[0]) if matrix else 0, columns):
            yield top // rows, left // columns, [(n, k) for n in range(top, min(top + rows, len(matrix)))
                                                 for k in range(left, min(left + columns, len(matrix[0])))]


def quantize_fp8_block(weight: torch.Tensor, block: Tuple[int, int], scale_kind: str):
    """(codes bytes (E, N, K), scale values [e][i][j]) of the spec's rule: scale amax / 448 rounded
    to float32 or bfloat16, or the least power of two 2^k with amax <= 448 * 2^k ("ue8m0"); all-zero
    blocks scale 1; codes the nearest E4M3 of value / scale."""
    values = weight.to(torch.float64).tolist()
    experts, rows, columns = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    codes = [[[0] * columns for _ in range(rows)] for _ in range(experts)]
    scales = [[[0.0] * grid[1] for _ in range(grid[0])] for _ in range(experts)]
    for e in range(experts):
        for i, j, cells in blocks_of(values[e], block[0], block[1]):
            amax = max(abs(values[e][n][k]) for n, k in cells)
            if amax == 0:
                scale = 1.0
            elif scale_kind == "ue8m0":
                exponent = -127
                while amax > 448 * 2.0 ** exponent:
                    exponent += 1
                scale = 2.0 ** exponent
            elif scale_kind == "float32":
                scale = to_float32(amax / 448)
            else:
                scale = torch.tensor(amax / 448, dtype=torch.float64).to(torch.bfloat16).item()
            scales[e][i][j] = scale
            for n, k in cells:
                codes[e][n][k] = nearest_e4m3(values[e][n][k] / scale)
    return torch.tensor(codes, dtype=torch.uint8).reshape(weight.shape), scales


def quantize_mxfp4(weight: torch.Tensor):
    """(codes (E, N, K), scale bytes (E, N, K / 32)) of OCP MX's rule: shared exponent
    floor(log2(amax)) - 2 clamped to [-127, 127] (0 for an all-zero block), codes the nearest E2M1 of
    value / 2^exponent."""
    values = weight.to(torch.float64).tolist()
    experts, rows, columns = weight.shape
    codes = [[[0] * columns for _ in range(rows)] for _ in range(experts)]
    scales = [[[0] * (columns // 32) for _ in range(rows)] for _ in range(experts)]
    for e in range(experts):
        for n in range(rows):
            for g in range(columns // 32):
                block = values[e][n][32 * g:32 * g + 32]
                amax = max(abs(v) for v in block)
                exponent = 0 if amax == 0 else max(math.frexp(amax)[1] - 1 - 2, -127)
                scales[e][n][g] = exponent + 127
                for i, v in enumerate(block):
                    codes[e][n][32 * g + i] = nearest_e2m1(v / 2.0 ** exponent)
    return torch.tensor(codes, dtype=torch.uint8).reshape(weight.shape), \
        torch.tensor(scales, dtype=torch.uint8).reshape(experts, rows, columns // 32)


def quantize_nvfp4(weight: torch.Tensor):
    """(codes (E, N, K), block scale bytes (E, N, K / 16), global scales [E]) of NVFP4's rule: global
    scale amax / (6 * 448) in float32 (at least float32's smallest normal; 1 for an all-zero matrix),
    block scale the nearest E4M3 of block amax / (6 * global), codes the nearest E2M1 of
    value / (block scale * global) (0 where that product is 0)."""
    values = weight.to(torch.float64).tolist()
    experts, rows, columns = weight.shape
    codes = [[[0] * columns for _ in range(rows)] for _ in range(experts)]
    block_scales = [[[0] * (columns // 16) for _ in range(rows)] for _ in range(experts)]
    global_scales = []
    for e in range(experts):
        amax = max((abs(v) for row in values[e] for v in row), default=0.0)
        global_scale = 1.0 if amax == 0 else to_float32(max(amax / 2688, 2.0 ** -126))
        global_scales.append(global_scale)
        for n in range(rows):
            for g in range(columns // 16):
                block = values[e][n][16 * g:16 * g + 16]
                scale_byte = nearest_e4m3(max(abs(v) for v in block) / (6 * global_scale))
                block_scales[e][n][g] = scale_byte
                step = e4m3fn_value(scale_byte) * global_scale
                for i, v in enumerate(block):
                    codes[e][n][16 * g + i] = nearest_e2m1(v / step) if step > 0 else 0
    return (torch.tensor(codes, dtype=torch.uint8).reshape(weight.shape),
            torch.tensor(block_scales, dtype=torch.uint8).reshape(experts, rows, columns // 16), global_scales)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """(..., P) bytes -> (..., 2P) codes, element by element."""
    data = packed.reshape(-1, packed.shape[-1]).tolist()
    out = [[nibble(row[k // 2], k) for k in range(2 * len(row))] for row in data]
    return torch.tensor(out, dtype=torch.uint8).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# -- random valid checkpoint tensors ----------------------------------------------------------------

def random_e4m3_bytes(shape: Sequence[int], generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Random float8_e4m3fn codes over every byte but the two NaNs."""
    codes = torch.randint(0, 254, tuple(shape), dtype=torch.int64, generator=generator)
    codes = codes + (codes >= 0x7F).to(torch.int64)  # 0..253 -> 0..254 without 0x7F (and never 0xFF)
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def random_packed(shape: Sequence[int]) -> torch.Tensor:
    """Random bytes: every pair of E2M1 codes."""
    return torch.randint(0, 256, tuple(shape), dtype=torch.uint8)


def random_e8m0(shape: Sequence[int], low: int = 0, high: int = 254) -> torch.Tensor:
    """Random E8M0 bytes in [low, high] (254 the largest finite)."""
    return torch.randint(low, high + 1, tuple(shape), dtype=torch.uint8)


def half_step_bound(magnitude: torch.Tensor) -> torch.Tensor:
    """The largest error rounding to the nearest E2M1 value can make at `magnitude` (in units of the
    scale): half the step between neighbours (0.25 below 2, 0.5 below 4, 1 up to 6), and beyond 6
    the distance to 6 (saturation)."""
    return torch.where(magnitude < 2, 0.25, torch.where(magnitude < 4, 0.5, torch.where(
        magnitude <= 6, 1.0, magnitude - 6)))
