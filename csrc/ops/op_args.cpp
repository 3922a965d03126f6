#include "op_args.h"

#include <limits>

#include "core_types.h"

namespace tutel {
namespace ops {
namespace {

void check_token_count(int64_t tokens, const char* op) {
  TORCH_CHECK_VALUE(tokens <= std::numeric_limits<int32_t>::max(), "tutel::", op,
                    ": at most 2^31-1 tokens are supported, got ", tokens);
}

// Validates optional weights [k, T]: any floating dtype and any strides, since the kernels
// read each weight in place and convert it to the accumulation dtype (no copy is made).
at::Tensor checked_weights(const c10::optional<at::Tensor>& weights, const at::Tensor& locations,
                           const char* op) {
  if (!weights.has_value()) return at::Tensor();
  check_floating(*weights, op, "weights");
  TORCH_CHECK_VALUE(weights->sizes() == locations.sizes(), "tutel::", op,
                    ": `weights` must have the shape of `indices` ", locations.sizes(), ", got ",
                    weights->sizes());
  check_same_device(locations, *weights, op, "weights");
  return *weights;
}

at::Tensor checked_other(const c10::optional<at::Tensor>& other, at::IntArrayRef shape,
                         const at::Tensor& data, const char* op) {
  if (!other.has_value()) return at::Tensor();
  check_dtype(*other, data.scalar_type(), op, "other");
  TORCH_CHECK_VALUE(other->sizes() == shape, "tutel::", op, ": `other` must have shape ", shape,
                    ", got ", other->sizes());
  check_same_device(data, *other, op, "other");
  return other->contiguous();
}

// The checks common to both directions; fills everything but other/experts/capacity.
SlotArgs slot_args(const at::Tensor& data, int64_t data_dim, const char* data_name,
                   const c10::optional<at::Tensor>& indices, const at::Tensor& locations,
                   const c10::optional<at::Tensor>& weights, const char* op) {
  check_dim(data, data_dim, op, data_name);
  check_floating(data, op, data_name);
  SlotArgs args;
  if (indices.has_value()) {
    check_slot_table(*indices, locations, op);
    check_same_device(data, *indices, op, "indices");
    args.indices = indices->contiguous();
  } else {
    check_dtype(locations, at::kInt, op, "locations");
    check_dim(locations, 2, op, "locations");
  }
  check_same_device(data, locations, op, "locations");
  args.data = data.contiguous();
  args.locations = locations.contiguous();
  args.k = args.locations.size(0);
  args.tokens = args.locations.size(1);
  args.model_dim = data.size(data_dim - 1);
  args.weights = checked_weights(weights, args.locations, op);
  return args;
}

}  // namespace

RouteTopkArgs route_topk_args(const at::Tensor& scores, int64_t k) {
  const char* op = "route_topk";
  check_dim(scores, 2, op, "scores");
  check_floating(scores, op, "scores");
  RouteTopkArgs args{scores.contiguous(), scores.size(0), scores.size(1)};
  check_token_count(args.tokens, op);
  TORCH_CHECK_VALUE(args.experts >= 1, "tutel::", op, ": scores must have at least one expert column");
  TORCH_CHECK_VALUE(k >= 1 && k <= args.experts, "tutel::", op, ": k=", k,
                    " is not allowed; k must satisfy 1 <= k <= num_experts=", args.experts);
  return args;
}

AssignArgs assign_locations_args(const at::Tensor& indices, int64_t experts,
                                 const c10::optional<at::Tensor>& priority) {
  const char* op = "assign_locations";
  check_dtype(indices, at::kInt, op, "indices");
  check_dim(indices, 2, op, "indices");
  check_token_count(indices.size(1), op);
  TORCH_CHECK_VALUE(experts >= 1 && experts <= std::numeric_limits<int32_t>::max(), "tutel::", op,
                    ": num_experts=", experts, " must be in [1, 2^31-1]");
  AssignArgs args{indices.contiguous(), at::Tensor()};
  if (priority.has_value()) {
    check_dim(*priority, 1, op, "priority");
    check_floating(*priority, op, "priority");
    TORCH_CHECK_VALUE(priority->size(0) == indices.size(1), "tutel::", op,
                      ": `priority` must have one entry per token (", indices.size(1), "), got ",
                      priority->size(0));
    check_same_device(indices, *priority, op, "priority");
    args.priority = priority->contiguous();
  }
  return args;
}

SlotArgs gather_slots_args(const at::Tensor& rows, const c10::optional<at::Tensor>& indices,
                           const at::Tensor& locations, const c10::optional<at::Tensor>& weights,
                           const c10::optional<at::Tensor>& other) {
  const char* op = "gather_slots";
  SlotArgs args = slot_args(rows, 3, "rows", indices, locations, weights, op);
  args.experts = rows.size(0);
  args.capacity = rows.size(1);
  args.other = checked_other(other, {args.tokens, args.model_dim}, args.data, op);
  return args;
}

SlotArgs scatter_slots_args(const at::Tensor& src, const c10::optional<at::Tensor>& indices,
                            const at::Tensor& locations, const c10::optional<at::Tensor>& weights,
                            const c10::optional<at::Tensor>& other, int64_t experts,
                            int64_t capacity) {
  const char* op = "scatter_slots";
  SlotArgs args = slot_args(src, 2, "src", indices, locations, weights, op);
  TORCH_CHECK_VALUE(experts >= 1, "tutel::", op, ": num_experts must be >= 1, got ", experts);
  TORCH_CHECK_VALUE(capacity >= 0, "tutel::", op, ": capacity must be >= 0, got ", capacity);
  TORCH_CHECK_VALUE(src.size(0) == args.tokens, "tutel::", op, ": `src` has ", src.size(0),
                    " rows but `indices` describes ", args.tokens, " tokens");
  args.experts = experts;
  args.capacity = capacity;
  args.other = checked_other(other, {experts, capacity, args.model_dim}, args.data, op);
  return args;
}

core::ChoiceWeights choice_weights(const at::Tensor& weights) {
  if (!weights.defined() || weights.numel() == 0) return core::ChoiceWeights{};
  core::WeightType type = core::WeightType::kFloat32;
  switch (weights.scalar_type()) {
    case at::kDouble: type = core::WeightType::kFloat64; break;
    case at::kHalf: type = core::WeightType::kFloat16; break;
    case at::kBFloat16: type = core::WeightType::kBFloat16; break;
    default: break;  // float32 (checked_weights allows only the four floating dtypes)
  }
  return core::ChoiceWeights{weights.data_ptr(), type, weights.stride(0), weights.stride(1)};
}

at::Tensor make_dots(const SlotArgs& args) {
  auto options = args.locations.options().dtype(accumulation_dtype(args.data.scalar_type()));
  return args.other.defined() ? at::empty({args.k, args.tokens}, options) : at::empty({0}, options);
}

at::ScalarType cumsum_output_dtype(at::ScalarType dtype) {
  const bool integral = dtype == at::kBool || dtype == at::kByte || dtype == at::kChar ||
                        dtype == at::kShort || dtype == at::kInt || dtype == at::kLong;
  const bool floating = dtype == at::kFloat || dtype == at::kDouble;
  TORCH_CHECK_TYPE(integral || floating, "tutel::cumsum_sub_one: `mask` must be bool, an integer "
                   "type, float32 or float64, got ", dtype);
  return floating ? dtype : at::kLong;
}

}  // namespace ops
}  // namespace tutel
