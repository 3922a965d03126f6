// What the kernel tests need of the storage types: a value read as double, and the relative
// rounding of storing one result (half an ulp of 1).
#pragma once

#include <cmath>

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

}  // namespace tutel_test
