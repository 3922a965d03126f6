// The routing weight of each choice, read where the caller keeps it: a [k, tokens]
// table of any floating type and any strides (such as a [tokens, k] tensor seen
// through .t()), so that no converted contiguous copy has to be made first.
#pragma once

#include <cstdint>

#include "scalar.h"

namespace tutel {
namespace core {

// The element types a weight table may have (numbered as kernels/kernel_abi.h's TUTEL_WEIGHTS_*).
enum class WeightType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Weight (j, t) is at data[j * choice_stride + t * token_stride]; data == nullptr: every weight is 1.
struct ChoiceWeights {
  const void* data = nullptr;
  WeightType type = WeightType::kFloat32;
  int64_t choice_stride = 0;
  int64_t token_stride = 0;
};

// Contiguous [k, tokens] weights of type A (or none).
template <class A>
inline ChoiceWeights contiguous_weights(const A* weights, int64_t tokens) {
  static_assert(sizeof(A) == 4 || sizeof(A) == 8, "float or double");
  return ChoiceWeights{weights, sizeof(A) == 8 ? WeightType::kFloat64 : WeightType::kFloat32, tokens, 1};
}

// Weight (j, t) in T's accumulation type.  A float64 weight with float32 accumulation is rounded
// to nearest, as Tensor.to(float32) does; every other conversion is exact.
template <class T>
inline acc_t<T> choice_weight(const ChoiceWeights& w, int64_t j, int64_t t) {
  using A = acc_t<T>;
  if (w.data == nullptr) return A(1);
  const int64_t at = j * w.choice_stride + t * w.token_stride;
  switch (w.type) {
    case WeightType::kFloat64: return static_cast<A>(static_cast<const double*>(w.data)[at]);
    case WeightType::kFloat16: return static_cast<A>(fp16_to_float(static_cast<const float16*>(w.data)[at]));
    case WeightType::kBFloat16: return static_cast<A>(bf16_to_float(static_cast<const bfloat16*>(w.data)[at]));
    case WeightType::kFloat32: break;
  }
  return static_cast<A>(static_cast<const float*>(w.data)[at]);
}

}  // namespace core
}  // namespace tutel
