// Argument checks of tutel::grouped_rows_linear and its backward, shared by the CPU
// (csrc/ops/cpu/grouped_rows_linear_cpu.cpp) and CUDA (csrc/ops/cuda/grouped_rows_linear_cuda.cpp)
// implementations so that both devices raise the same errors.  Shapes, dtypes and devices only:
// the values of `offsets` live on the device, and only the CPU operator reads them.
#pragma once

#include <ATen/ATen.h>

namespace tutel {
namespace ops {

// The operands in the layouts the implementations read, and their sizes.
struct GroupedRowsArgs {
  at::Tensor rows;     // [N, K], elements contiguous within each row (any row stride)
  at::Tensor weight;   // [E, O, K] (F.linear layout), or [E, K, O] when transposed; contiguous
  at::Tensor bias;     // [E, O] contiguous, or undefined
  at::Tensor offsets;  // [E] int32 contiguous
  int64_t rows_count = 0, depth = 0, outputs = 0, experts = 0;
};

// `op` names the operator in messages.
GroupedRowsArgs checked_grouped_rows(const char* op, const at::Tensor& rows, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias, const at::Tensor& offsets,
                                     bool transposed);

// The backward's output gradient [N, O] for `args`, contiguous.
at::Tensor checked_grouped_rows_grad(const char* op, const at::Tensor& grad, const GroupedRowsArgs& args);

}  // namespace ops
}  // namespace tutel
