// Maps PyTorch scalar types onto the core's storage types.
#pragma once

#include <ATen/ATen.h>

#include "../core/scalar.h"

namespace tutel {
namespace ops {

template <class T>
struct CoreType {
  using type = T;
};
template <>
struct CoreType<c10::BFloat16> {
  using type = core::bfloat16;
};
template <>
struct CoreType<c10::Half> {
  using type = core::float16;
};

template <class T>
using core_t = typename CoreType<T>::type;

template <class T>
inline core_t<T>* core_ptr(const at::Tensor& t) {
  static_assert(sizeof(core_t<T>) == sizeof(T), "storage types must match");
  return reinterpret_cast<core_t<T>*>(t.data_ptr<T>());
}

// A 2-D tensor as rows the core kernels read through a row stride: itself when its elements are
// contiguous within each row and rows do not overlap (a row-strided view, such as one half of a
// fused gate+up product, is read in place), else a contiguous copy.
inline at::Tensor rows_with_unit_stride(const at::Tensor& t) {
  return t.stride(1) == 1 && t.stride(0) >= t.size(1) ? t : t.contiguous();
}

// The dtype in which weights and dot products of data of type `dtype` live.
inline at::ScalarType accumulation_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace ops
}  // namespace tutel
