// Inner loops over one row of M elements.  Written as plain loops over
// contiguous memory so the compiler vectorises them.
#pragma once

#include <cstdint>
#include <cstring>

#include "scalar.h"

namespace tutel {
namespace core {

// dst = w * src
template <class T>
inline void scale_row(T* dst, const T* src, acc_t<T> w, int64_t M) {
  if (w == acc_t<T>(1)) {
    std::memcpy(dst, src, sizeof(T) * M);
    return;
  }
  for (int64_t m = 0; m < M; ++m) dst[m] = Scalar<T>::store(w * Scalar<T>::load(src[m]));
}

// acc = w * src   (acc in the accumulation type)
template <class T>
inline void scale_into(acc_t<T>* acc, const T* src, acc_t<T> w, int64_t M) {
  for (int64_t m = 0; m < M; ++m) acc[m] = w * Scalar<T>::load(src[m]);
}

// acc += w * src
template <class T>
inline void add_scaled_into(acc_t<T>* acc, const T* src, acc_t<T> w, int64_t M) {
  for (int64_t m = 0; m < M; ++m) acc[m] += w * Scalar<T>::load(src[m]);
}

template <class T>
inline void store_row(T* dst, const acc_t<T>* acc, int64_t M) {
  for (int64_t m = 0; m < M; ++m) dst[m] = Scalar<T>::store(acc[m]);
}

// dst += w * src, rounding once per element.
template <class T>
inline void add_scaled_row(T* dst, const T* src, acc_t<T> w, int64_t M) {
  for (int64_t m = 0; m < M; ++m)
    dst[m] = Scalar<T>::store(Scalar<T>::load(dst[m]) + w * Scalar<T>::load(src[m]));
}

template <class T>
inline void zero_row(T* dst, int64_t M) {
  std::memset(static_cast<void*>(dst), 0, sizeof(T) * M);
}

// <a, b> with eight independent partial sums, so the loop vectorises without
// relaxing floating-point rules.
template <class T>
inline acc_t<T> dot_row(const T* a, const T* b, int64_t M) {
  using A = acc_t<T>;
  A partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t m = 0;
  for (; m + 8 <= M; m += 8)
    for (int i = 0; i < 8; ++i) partial[i] += Scalar<T>::load(a[m + i]) * Scalar<T>::load(b[m + i]);
  A tail = 0;
  for (; m < M; ++m) tail += Scalar<T>::load(a[m]) * Scalar<T>::load(b[m]);
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7])) + tail;
}

}  // namespace core
}  // namespace tutel
