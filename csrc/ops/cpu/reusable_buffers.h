// Output tensors of tutel's CPU operators whose memory is reused between calls
// (core/block_cache.h says why).
#pragma once

#include <ATen/ATen.h>

namespace tutel {
namespace ops {

// Like at::empty(sizes, options) on the CPU; buffers of 1 MiB and more come from the
// block cache and go back to it when the tensor is freed.
at::Tensor empty_reusable(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace ops
}  // namespace tutel
