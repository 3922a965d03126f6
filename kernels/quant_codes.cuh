// The values of the quantized weight formats' codes (expert_abi.h's TUTEL_QUANT_*), decoded by bit
// placement into float32, exactly: shared by the kernels that read quantized stacks
// (quantized_decode.cu, quantized_grouped_linear.cu).
#pragma once

// E2M1 (OCP MX v1.0): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0.  Placed as a
// float32's sign, the exponent field's two lowest bits and the mantissa's top bit, the code
// reads as its value times 2^-126 (code 1, the subnormal 0.5, included), so one exact product
// by 2^126 gives the value: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
__device__ __forceinline__ float e2m1_value(unsigned code) {
  return __uint_as_float(((code & 7u) << 22) | ((code & 8u) << 28)) * 0x1p126f;
}

// E4M3 "fn": sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; 0x7f and 0xff are NaN,
// no infinities.  Placed as a float32's sign, exponent field's four lowest bits and top three
// mantissa bits, the byte reads as its value times 2^-120 (subnormals included).
__device__ __forceinline__ float e4m3_value(unsigned byte) {
  if ((byte & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);
  return __uint_as_float(((byte & 0x7fu) << 20) | ((byte & 0x80u) << 24)) * 0x1p120f;
}

// E8M0: 2^(s - 127); s = 255 is NaN, s = 0 the float32 subnormal 2^-127.
__device__ __forceinline__ float e8m0_value(unsigned s) {
  if (s == 255u) return __uint_as_float(0x7fc00000u);
  return s == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23);
}

// The E4M3 (fn) value nearest to x, ties to the even code (OCP 8-bit floating point's rounding,
// as PyTorch's .to(torch.float8_e4m3fn) rounds), saturating: magnitudes past 464 (the midpoint
// between 448 and the next binade's 480, which E4M3 fn spends on NaN) and infinities give 448
// (PyTorch's conversion gives NaN from 480 on); NaN stays NaN; the sign is kept (-0 too).  Normal
// E4M3 magnitudes (2^-6 and up) keep float32's top three mantissa bits, rounded on the bits with
// the even-tie rule (a carry moves to the next binade); below 2^-6 the values are multiples of
// 2^-9, rounded by rintf (ties to even) of the exact product by 2^9.
__device__ __forceinline__ float e4m3_rounded(float x) {
  const unsigned bits = __float_as_uint(x), sign = bits & 0x80000000u, magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return x;
  float rounded;
  if (magnitude >= 0x3c800000u) {  // 2^-6
    rounded = __uint_as_float((magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) & 0xfff00000u);
    if (rounded > 448.0f) rounded = 448.0f;
  } else {
    rounded = rintf(__uint_as_float(magnitude) * 512.0f) * 0x1p-9f;
  }
  return __uint_as_float(__float_as_uint(rounded) | sign);
}
