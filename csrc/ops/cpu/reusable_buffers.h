// Output tensors of tutel's CPU operators whose memory is reused between calls
// (core/block_cache.h says why).
#pragma once

#include <ATen/ATen.h>

namespace tutel {
namespace ops {

// Like at::empty(sizes, options) on the CPU; buffers of 1 MiB and more come from the
// block cache and go back to it when the tensor is freed.
at::Tensor empty_reusable(at::IntArrayRef sizes, const at::TensorOptions& options);

// x.to(dtype) as a contiguous copy in a buffer from empty_reusable.
at::Tensor to_dtype_reusable(const at::Tensor& x, at::ScalarType dtype);

}  // namespace ops
}  // namespace tutel
