// Argument checks of tutel::add_expert_bias_, expert_row_sums and choice_rows, shared by the CPU
// (csrc/ops/cpu/expert_rows_cpu.cpp) and CUDA (csrc/ops/cuda/expert_rows_cuda.cpp)
// implementations so that both devices raise the same errors.  Only shapes, dtypes, devices and
// strides are checked here: the values of `offsets` and `slot_choices` live on the device, and
// only the CPU operators read them (see their files).
#pragma once

#include <ATen/ATen.h>

namespace tutel {
namespace ops {

// Rows grouped by expert and their experts' ends, as the kernels read them.
struct GroupedRows {
  at::Tensor rows;     // [N, C] floating point, elements contiguous within each row
  at::Tensor offsets;  // [E] int32, contiguous
};

// add_expert_bias_'s rows (in place: the caller's tensor itself, never a copy, so its elements
// must be contiguous within each row and rows must not overlap), bias [E, C] of rows' dtype and
// device (read through its row stride) and offsets [E] int32 on rows' device.
struct ExpertBias {
  at::Tensor bias;
  at::Tensor offsets;
};
ExpertBias checked_add_expert_bias(const at::Tensor& rows, const at::Tensor& bias, const at::Tensor& offsets);

// expert_row_sums' rows (a contiguous copy unless each row's elements are contiguous) and offsets.
GroupedRows checked_expert_row_sums(const at::Tensor& rows, const at::Tensor& offsets);

// choice_rows' x [T, H] (floating point; a contiguous copy unless each row's elements are
// contiguous), slot_choices [N] int64 on x's device (contiguous) and k >= 1.
struct ChoiceRows {
  at::Tensor x;
  at::Tensor slot_choices;
};
ChoiceRows checked_choice_rows(const at::Tensor& x, const at::Tensor& slot_choices, int64_t k);

}  // namespace ops
}  // namespace tutel
