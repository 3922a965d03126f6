// Portable row kernels and the run-time choice between them and the AVX2 ones.
#include "row_kernels.h"

#include <algorithm>

namespace tutel {
namespace core {
namespace {

template <class T>
void portable_weighted_sum(T* dst, const T* const* rows, const acc_t<T>* weights, int n, int64_t M) {
  using A = acc_t<T>;
  if constexpr (is_native_v<T>) {
    // Accumulate in the output row itself, one row at a time.
    const A w0 = weights ? weights[0] : A(1);
    for (int64_t m = 0; m < M; ++m) dst[m] = w0 * rows[0][m];
    for (int i = 1; i < n; ++i) {
      const A w = weights ? weights[i] : A(1);
      const T* row = rows[i];
      for (int64_t m = 0; m < M; ++m) dst[m] = dst[m] + w * row[m];
    }
  } else {
    // 16-bit rows: accumulate a block in float, round once when storing.
    constexpr int64_t kBlock = 256;
    A acc[kBlock];
    for (int64_t begin = 0; begin < M; begin += kBlock) {
      const int64_t len = std::min<int64_t>(kBlock, M - begin);
      const A w0 = weights ? weights[0] : A(1);
      for (int64_t m = 0; m < len; ++m) acc[m] = w0 * Scalar<T>::load(rows[0][begin + m]);
      for (int i = 1; i < n; ++i) {
        const A w = weights ? weights[i] : A(1);
        const T* row = rows[i] + begin;
        for (int64_t m = 0; m < len; ++m) acc[m] = acc[m] + w * Scalar<T>::load(row[m]);
      }
      for (int64_t m = 0; m < len; ++m) dst[begin + m] = Scalar<T>::store(acc[m]);
    }
  }
}

template <class T>
acc_t<T> portable_dot(const T* a, const T* b, int64_t M) {
  using A = acc_t<T>;
  A partial[kDotLanes] = {};
  int64_t m = 0;
  for (; m + kDotLanes <= M; m += kDotLanes)
    for (int i = 0; i < kDotLanes; ++i)
      partial[i] = partial[i] + Scalar<T>::load(a[m + i]) * Scalar<T>::load(b[m + i]);
  A tail = 0;
  for (; m < M; ++m) tail = tail + Scalar<T>::load(a[m]) * Scalar<T>::load(b[m]);
  return dot_reduce(partial, tail);
}

}  // namespace

template <class T>
const RowKernels<T>& portable_row_kernels() {
  static const RowKernels<T> kernels{&portable_weighted_sum<T>, &portable_dot<T>};
  return kernels;
}

template <class T>
const RowKernels<T>& row_kernels() {
  static const RowKernels<T>* chosen = [] {
    const RowKernels<T>* vectorised = avx2_row_kernels<T>();
    return vectorised ? vectorised : &portable_row_kernels<T>();
  }();
  return *chosen;
}

#define TUTEL_INSTANTIATE_ROW_KERNELS(T)                      \
  template const RowKernels<T>& portable_row_kernels<T>(); \
  template const RowKernels<T>& row_kernels<T>();

TUTEL_INSTANTIATE_ROW_KERNELS(float)
TUTEL_INSTANTIATE_ROW_KERNELS(double)
TUTEL_INSTANTIATE_ROW_KERNELS(bfloat16)
TUTEL_INSTANTIATE_ROW_KERNELS(float16)

}  // namespace core
}  // namespace tutel
