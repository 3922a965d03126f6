// The inner loops of dispatch and combine: operations on whole rows of M
// elements.  Each has a portable version (plain loops the compiler vectorises
// for the baseline instruction set) and, on x86-64 CPUs with AVX2 and F16C, a
// hand-vectorised one chosen once at run time (the build cannot assume the
// machine it runs on, so there is no -march flag to rely on).
//
// Both versions perform the same floating-point operations in the same order,
// so results are bitwise identical whichever runs (up to which NaN a NaN result
// is): no fused multiply-add, the same lane layout for partial sums, and 16-bit
// values rounded to nearest even with NaN stored as in scalar.h.
#pragma once

#include <cstdint>

#include "scalar.h"

namespace tutel {
namespace core {

// Partial sums kept by dot(): element m adds into partial m % kDotLanes, and the
// partials are reduced in a fixed tree (see dot_reduce).  Four vectors of eight
// lanes, so the vectorised loop has four independent addition chains.
constexpr int kDotLanes = 32;

template <class T>
struct RowKernels {
  using A = acc_t<T>;
  // dst[m] = sum_{i < n} weights[i] * rows[i][m], summed in i order in the
  // accumulation type and rounded once.  n >= 1; weights == nullptr means 1.
  void (*weighted_sum)(T* dst, const T* const* rows, const A* weights, int n, int64_t M);
  // <a, b> with kDotLanes partial sums.
  A (*dot)(const T* a, const T* b, int64_t M);
};

// The fastest kernels this CPU supports (selected on first use).
template <class T>
const RowKernels<T>& row_kernels();

// The portable kernels, always available (used by the tests as the reference
// for the vectorised ones).
template <class T>
const RowKernels<T>& portable_row_kernels();

// The AVX2 + F16C kernels, or nullptr when this build or this CPU has none.
template <class T>
const RowKernels<T>* avx2_row_kernels();

// The fixed reduction of dot()'s kDotLanes partial sums plus the tail.
template <class A>
inline A dot_reduce(const A* partial, A tail) {
  A lane[8];
  for (int i = 0; i < 8; ++i)
    lane[i] = (partial[i] + partial[8 + i]) + (partial[16 + i] + partial[24 + i]);
  return (((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))) +
         tail;
}

}  // namespace core
}  // namespace tutel
