// Argument checks shared by the operator implementations.  The Python layer
// validates first and gives friendlier messages; these keep direct
// torch.ops.tutel.* callers from reaching the kernels with bad tensors.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../core/status.h"

namespace tutel {
namespace ops {

inline void check_dtype(const at::Tensor& t, at::ScalarType expected, const char* op,
                        const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == expected, "tutel::", op, ": `", name, "` must have dtype ",
                   expected, ", got ", t.scalar_type());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == dim, "tutel::", op, ": `", name, "` must be ", dim,
                    "-D, got shape ", t.sizes());
}

inline void check_floating(const at::Tensor& t, const char* op, const char* name) {
  auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kFloat || d == at::kDouble || d == at::kBFloat16 || d == at::kHalf,
                   "tutel::", op, ": `", name,
                   "` must be float32, float64, bfloat16 or float16, got ", d);
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op,
                              const char* name) {
  TORCH_CHECK_VALUE(a.device() == b.device(), "tutel::", op, ": `", name, "` is on ", b.device(),
                    " but the data is on ", a.device());
}

// The group ends of rows grouped by expert: `offsets` [E] int32 on `data`'s device, returned
// contiguous.  Only the layout: their values live on the device (the CPU operators read them).
inline at::Tensor checked_offsets(const at::Tensor& offsets, const at::Tensor& data, const char* op) {
  check_dim(offsets, 1, op, "offsets");
  check_dtype(offsets, at::kInt, op, "offsets");
  check_same_device(data, offsets, op, "offsets");
  return offsets.contiguous();
}

// A routed call's choices for tokens x [T, ...]: expert_ids int32 / int64 [T, k] and weights, when
// given, floating point of expert_ids' shape, both on x's device.
inline void check_routed_choices(const at::Tensor& x, const at::Tensor& expert_ids,
                                 const c10::optional<at::Tensor>& weights, const char* op) {
  check_dim(expert_ids, 2, op, "expert_ids");
  const at::ScalarType dtype = expert_ids.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kInt || dtype == at::kLong, "tutel::", op,
                   ": `expert_ids` must be int32 or int64, got ", dtype);
  TORCH_CHECK_VALUE(expert_ids.size(0) == x.size(0), "tutel::", op, ": `expert_ids` must be [T, k] with T = ",
                    x.size(0), " rows of `x`, got ", expert_ids.sizes());
  check_same_device(x, expert_ids, op, "expert_ids");
  if (weights.has_value()) {
    check_floating(*weights, op, "weights");
    TORCH_CHECK_VALUE(weights->sizes() == expert_ids.sizes(), "tutel::", op,
                      ": `weights` must have the shape of `expert_ids` ", expert_ids.sizes(), ", got ",
                      weights->sizes());
    check_same_device(x, *weights, op, "weights");
  }
}

// indices and locations: int32 [k, T] of the same shape.  (Operators make
// their inputs contiguous themselves, so callers may pass views.)
inline void check_slot_table(const at::Tensor& indices, const at::Tensor& locations,
                             const char* op) {
  check_dtype(indices, at::kInt, op, "indices");
  check_dtype(locations, at::kInt, op, "locations");
  check_dim(indices, 2, op, "indices");
  TORCH_CHECK_VALUE(indices.sizes() == locations.sizes(), "tutel::", op,
                    ": `indices` and `locations` must have the same shape [k, tokens], got ",
                    indices.sizes(), " and ", locations.sizes());
}

// Turns a core error into a Python IndexError / ValueError naming the entry;
// `context`, when given, follows the message in parentheses (where the error
// was found).  The message is built here rather than added to a caught
// c10::Error with add_context, which makes c10 render the captured C++
// backtrace into the message.
inline void raise_if_failed(const core::Status& status, const char* op, const std::string& context = "") {
  if (status.ok()) return;
  const std::string suffix = context.empty() ? "" : " (" + context + ")";
  if (status.code == core::StatusCode::kExpertIndexOutOfRange) {
    TORCH_CHECK_INDEX(false, "tutel::", op, ": expert index ", status.value,
                      " (choice ", status.choice, ", token ", status.token,
                      ") is out of range; indices must satisfy 0 <= index < num_experts", suffix);
  }
  TORCH_CHECK_VALUE(false, "tutel::", op, ": location ", status.value, " (choice ", status.choice,
                    ", token ", status.token, ") is negative; locations must be >= 0", suffix);
}

}  // namespace ops
}  // namespace tutel
