"""The element and scale codes the quantized formats share, decoded from their bit layouts.

* E2M1 (OCP MX v1.0's FP4 element): sign in bit 3, two exponent bits (bias 1), one mantissa bit,
  no infinity or NaN: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.  Two codes per byte, the even
  element in the low nibble.
* E4M3 (OCP FP8, ``torch.float8_e4m3fn``): sign, four exponent bits (bias 7), three mantissa bits;
  S.1111.111 is NaN, there is no infinity, the largest magnitude is 448.
* E8M0 (the MX scale, ``torch.float8_e8m0fnu``): eight exponent bits, bias 127, value 2^(e - 127);
  255 is NaN.

The value tables are computed here from those bit layouts (not taken from a float cast), so the
reference dequantizers follow the specifications alone.  Encoders round to nearest with ties to
even and saturate at the format's largest magnitude.
"""
import math
from typing import Optional, Tuple

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
# float8_e8m0fnu first ships in PyTorch 2.7; on older releases E8M0 scales travel as uint8 bytes.
FLOAT8_E8M0FNU: Optional[torch.dtype] = getattr(torch, "float8_e8m0fnu", None)
# float4_e2m1fn_x2 (two E2M1 codes in one byte) first ships in PyTorch 2.8.
FLOAT4_E2M1FN_X2: Optional[torch.dtype] = getattr(torch, "float4_e2m1fn_x2", None)


def _minifloat(code: int, exponent_bits: int, mantissa_bits: int, bias: int) -> float:
    """The value of a sign/exponent/mantissa code (IEEE-style: exponent field 0 is subnormal)."""
    mantissa = code & ((1 << mantissa_bits) - 1)
    exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
    sign = -1.0 if (code >> (exponent_bits + mantissa_bits)) & 1 else 1.0
    if exponent == 0:
        return sign * math.ldexp(mantissa / (1 << mantissa_bits), 1 - bias)
    return sign * math.ldexp(1.0 + mantissa / (1 << mantissa_bits), exponent - bias)


# E2M1 has no special codes: all 16 are numbers (code 8 is -0.0).
E2M1_VALUES: Tuple[float, ...] = tuple(_minifloat(code, 2, 1, 1) for code in range(16))
# E4M3 ("fn": finite, no infinity) spends only S.1111.111 on NaN.
E4M3FN_VALUES: Tuple[float, ...] = tuple(
    math.nan if code & 0x7F == 0x7F else _minifloat(code, 4, 3, 7) for code in range(256))

# index = magnitude * 2 for the eight E2M1 magnitudes -> their code (the unused entries stay 0)
_E2M1_CODE_OF_DOUBLED_MAGNITUDE = [0] * 13
for _code in range(8):
    _E2M1_CODE_OF_DOUBLED_MAGNITUDE[int(E2M1_VALUES[_code] * 2)] = _code


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent in float64, exactly, for integer exponents in [-1022, 1023] (built from the bits:
    float64's exponent field, bias 1023, and a zero mantissa)."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def floor_log2(values: torch.Tensor) -> torch.Tensor:
    """floor(log2(|v|)) of float64 values as int64, exactly (frexp: v = m * 2^e, 0.5 <= |m| < 1).
    Zero gives -1; callers treat zero themselves."""
    _, exponent = torch.frexp(values.to(torch.float64))
    return exponent.to(torch.int64) - 1


def ceil_log2(values: torch.Tensor) -> torch.Tensor:
    """ceil(log2(v)) of positive float64 values as int64, exactly."""
    mantissa, exponent = torch.frexp(values.to(torch.float64))
    exponent = exponent.to(torch.int64)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def round_to_minifloat(values: torch.Tensor, mantissa_bits: int, min_exponent: int,
                       max_magnitude: float) -> torch.Tensor:
    """Float64 `values` rounded to the nearest number of a binary format with `mantissa_bits`
    mantissa bits and smallest normal exponent `min_exponent` (below it the subnormals' fixed
    step), ties to even, magnitudes above `max_magnitude` saturated to it; the sign (also of
    zero) kept.  The result is exactly representable in that format."""
    values = values.to(torch.float64)
    magnitude = values.abs()
    exponent = floor_log2(magnitude).clamp(min=min_exponent)
    step = power_of_two(exponent - mantissa_bits)
    # magnitude / step is exact (a power-of-two division); torch.round takes ties to even, and an
    # even multiple of the step is a code with an even (zero) last mantissa bit.
    rounded = (torch.round(magnitude / step) * step).clamp(max=max_magnitude)
    return torch.copysign(rounded, values)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Float64 values of E2M1 codes (integers 0..15, any integer dtype)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=codes.device)
    return table[codes.to(torch.int64)]


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of float64 values: round to nearest, ties to even, saturate at
    +-6; bit 3 carries the sign (of zero too).  The values must be finite."""
    rounded = round_to_minifloat(values, mantissa_bits=1, min_exponent=0, max_magnitude=E2M1_MAX)
    code_of = torch.tensor(_E2M1_CODE_OF_DOUBLED_MAGNITUDE, dtype=torch.uint8, device=values.device)
    codes = code_of[(rounded.abs() * 2).to(torch.int64)]
    return codes | (torch.signbit(rounded).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) E2M1 codes -> (..., K / 2) uint8 bytes, element 2j in the low nibble of byte j."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: shape {tuple(codes.shape)} has an odd last dimension; two codes fill a byte")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., P) uint8 bytes -> (..., 2P) uint8 E2M1 codes (low nibble first)."""
    packed = packed.view(torch.uint8)
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def decode_e4m3fn(codes: torch.Tensor) -> torch.Tensor:
    """Float64 values of a float8_e4m3fn tensor (or its uint8 bytes), NaN for S.1111.111."""
    table = torch.tensor(E4M3FN_VALUES, dtype=torch.float64, device=codes.device)
    return table[codes.view(torch.uint8).to(torch.int64)]


def encode_e4m3fn(values: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn of finite float64 values: round to nearest, ties to even, saturate at +-448
    (rounded here in float64, so no intermediate float32 rounding can move a tie)."""
    rounded = round_to_minifloat(values, mantissa_bits=3, min_exponent=-6, max_magnitude=E4M3_MAX)
    return rounded.to(torch.float8_e4m3fn)  # exact: every rounded value is an E4M3 number


def e4m3fn_nan(codes: torch.Tensor) -> torch.Tensor:
    """Where a float8_e4m3fn tensor (or its bytes) holds NaN (S.1111.111)."""
    return (codes.view(torch.uint8) & 0x7F) == 0x7F


def decode_e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Float64 2^(e - 127) of E8M0 bytes (uint8 or float8_e8m0fnu), NaN for 255."""
    exponents = exponents.view(torch.uint8).to(torch.int64)
    return torch.where(exponents == E8M0_NAN, math.nan, power_of_two(exponents - E8M0_BIAS))
