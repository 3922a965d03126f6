// What the kernel tests need of the storage types: a value read as double, its bit pattern, and
// the relative rounding of storing one result (half an ulp of 1).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/scalar.h"

namespace tutel_test {

inline double unit_rounding(float) { return std::ldexp(1.0, -24); }
inline double unit_rounding(double) { return std::ldexp(1.0, -53); }
inline double unit_rounding(tutel::core::bfloat16) { return std::ldexp(1.0, -8); }
inline double unit_rounding(tutel::core::float16) { return std::ldexp(1.0, -11); }

template <class T>
double value(T v) {
  return double(tutel::core::Scalar<T>::load(v));
}

// The bits of a value, to compare results that must be identical (NaN included).
template <class T>
uint64_t bits_of(T v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

}  // namespace tutel_test
