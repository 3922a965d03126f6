// csrc/core's element type for the dtype variant a kernel source is built in (the kernels see
// only `storage_t`, the raw bits), and the conversion of test values into those bits. Included
// after the kernel sources, which define storage_t and acc_t.
#pragma once

#include <type_traits>

#include "core/scalar.h"

namespace kernels_on_cpu {

#if defined(TUTEL_DTYPE_FLOAT16)
using CoreT = tutel::core::float16;
inline storage_t storage_of(float v) { return tutel::core::float_to_fp16(v).bits; }
#elif defined(TUTEL_DTYPE_BFLOAT16)
using CoreT = tutel::core::bfloat16;
inline storage_t storage_of(float v) { return tutel::core::float_to_bf16(v).bits; }
#else
using CoreT = storage_t;
inline storage_t storage_of(float v) { return storage_t(v); }
#endif
static_assert(sizeof(CoreT) == sizeof(storage_t), "the core reads the kernels' layout");
static_assert(std::is_same<acc_t, tutel::core::acc_t<CoreT>>::value, "kernels and core accumulate alike");

}  // namespace kernels_on_cpu
