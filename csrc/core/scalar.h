// Scalar storage types and their accumulation rules, free of any framework.
//
// bfloat16 and float16 are stored as raw 16-bit patterns so that a pointer to
// c10::BFloat16 / c10::Half data can be reinterpreted as a pointer to these
// types (both are a single uint16_t).  Arithmetic on them always happens in
// float32; float64 data is computed in float64 end to end.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tutel {
namespace core {

struct bfloat16 {
  uint16_t bits;
};

struct float16 {
  uint16_t bits;
};

static_assert(sizeof(bfloat16) == 2 && sizeof(float16) == 2, "16-bit types must stay 2 bytes");

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bf16_to_float(bfloat16 v) { return bits_to_float(uint32_t(v.bits) << 16); }

// Round to nearest, ties to even; NaN becomes the quiet NaN 0x7fc0 (same rule
// as PyTorch).  Written without a branch so loops over rows vectorise.
inline bfloat16 float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return bfloat16{uint16_t(is_nan ? 0x7fc0u : rounded)};
}

inline float fp16_to_float(float16 v) {
  uint32_t h = v.bits;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  // Subnormal half: value = mantissa * 2^-24, exact in float32.
  float magnitude = float(mantissa) * (1.0f / 16777216.0f);
  return sign ? -magnitude : magnitude;
}

// Round to nearest, ties to even, with overflow to infinity and gradual underflow.
inline float16 float_to_fp16(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return float16{uint16_t(sign | 0x7e00u)};
  if (abs_bits >= 0x477ff000u) return float16{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520
  if (abs_bits < 0x38800000u) {
    // Result is subnormal (or zero): scale so that the half ulp 2^-24 becomes 1.0
    // and let the float unit round to nearest even.
    float scaled = bits_to_float(abs_bits) * 16777216.0f;
    uint32_t mantissa = uint32_t(scaled);
    float remainder = scaled - float(mantissa);
    if (remainder > 0.5f || (remainder == 0.5f && (mantissa & 1u))) ++mantissa;
    return float16{uint16_t(sign | mantissa)};
  }
  uint32_t rounding_bias = 0xfffu + ((abs_bits >> 13) & 1u);
  uint32_t rebased = abs_bits - (112u << 23) + rounding_bias;
  return float16{uint16_t(sign | (rebased >> 13))};
}

// Scalar<T>: how a storage type is read into and written from its accumulation type.
template <class T>
struct Scalar;

template <>
struct Scalar<float> {
  using acc = float;
  static acc load(float v) { return v; }
  static float store(acc v) { return v; }
};

template <>
struct Scalar<double> {
  using acc = double;
  static acc load(double v) { return v; }
  static double store(acc v) { return v; }
};

template <>
struct Scalar<bfloat16> {
  using acc = float;
  static acc load(bfloat16 v) { return bf16_to_float(v); }
  static bfloat16 store(acc v) { return float_to_bf16(v); }
};

template <>
struct Scalar<float16> {
  using acc = float;
  static acc load(float16 v) { return fp16_to_float(v); }
  static float16 store(acc v) { return float_to_fp16(v); }
};

template <class T>
using acc_t = typename Scalar<T>::acc;

// True when T is its own accumulation type, so rows can be accumulated in place.
template <class T>
constexpr bool is_native_v = std::is_same<T, acc_t<T>>::value;

}  // namespace core
}  // namespace tutel
