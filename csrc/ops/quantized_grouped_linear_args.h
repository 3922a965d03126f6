// Argument checks of tutel::quantized_grouped_linear (schemas.cpp): the rows, the group ends, the
// quantized stack (quantized_stack_args.h) and the bias, naming the operator and the argument.
// The checked tensors come back in the layouts the kernels read (gemm/quantized_products.h,
// kernels/quantized_grouped_linear.cu).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "quantized_stack_args.h"

namespace tutel {
namespace ops {

struct QuantizedGroupedLinearArgs {
  core::QuantFormat format = core::QuantFormat::kMxfp4;
  at::Tensor rows;               // [n, K], unit stride along K
  std::vector<int64_t> offsets;  // [E + 1]: 0, then the ends (read_ends only, else empty)
  QuantizedStackArgs stack;      // [E, N, K]
  at::Tensor bias;               // float32 [E, N] contiguous, or undefined
  int64_t experts = 0;
  int64_t block_rows = 1, block_cols = 1;  // fp8_block's scale block
  int64_t activation_group = 0;            // W8A8's group width (fp8_block only), 0: weight-only
};

// With read_ends (the CPU), the ends' values are read and checked (non-decreasing within [0, n]);
// without (CUDA, where that would synchronise with the host), only their dtype, shape and device,
// and the kernel reads them as their clamped running maximum.  activation_group: 0, or (fp8_block
// only) W8A8's group width g, a multiple of 16 or at least K (every 16-wide step of the CUDA
// kernel's reduction lies in one group).
QuantizedGroupedLinearArgs quantized_grouped_linear_args(const at::Tensor& rows, const at::Tensor& ends,
                                                         const std::string& format, const at::Tensor& codes,
                                                         const at::Tensor& scales,
                                                         const c10::optional<at::Tensor>& global_scale,
                                                         at::IntArrayRef block, const c10::optional<at::Tensor>& bias,
                                                         int64_t activation_group, bool read_ends = true);

}  // namespace ops
}  // namespace tutel
