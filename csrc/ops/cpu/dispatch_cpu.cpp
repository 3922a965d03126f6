// CPU implementations of gather_slots and scatter_slots (encode / decode and
// their backward passes).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <tuple>

#include "../../core/dispatch.h"
#include "../checks.h"
#include "../core_types.h"

namespace tutel {
namespace ops {
namespace {

// Validates optional weights [k, T] (accumulation dtype) and returns them contiguous.
at::Tensor checked_weights(const c10::optional<at::Tensor>& weights, const at::Tensor& indices,
                           at::ScalarType data_dtype, const char* op) {
  if (!weights.has_value()) return at::Tensor();
  check_dtype(*weights, accumulation_dtype(data_dtype), op, "weights");
  TORCH_CHECK_VALUE(weights->sizes() == indices.sizes(), "tutel::", op,
                    ": `weights` must have the shape of `indices` ", indices.sizes(), ", got ",
                    weights->sizes());
  check_same_device(indices, *weights, op, "weights");
  return weights->contiguous();
}

at::Tensor checked_other(const c10::optional<at::Tensor>& other, at::IntArrayRef shape,
                         at::ScalarType dtype, const char* op) {
  if (!other.has_value()) return at::Tensor();
  check_dtype(*other, dtype, op, "other");
  TORCH_CHECK_VALUE(other->sizes() == shape, "tutel::", op, ": `other` must have shape ", shape,
                    ", got ", other->sizes());
  return other->contiguous();
}

at::Tensor make_dots(const at::Tensor& other, const at::Tensor& indices, at::ScalarType dtype) {
  auto options = indices.options().dtype(accumulation_dtype(dtype));
  return other.defined() ? at::empty(indices.sizes(), options) : at::empty({0}, options);
}

core::SlotTable slot_table(const at::Tensor& indices, const at::Tensor& locations, int64_t experts,
                           int64_t capacity) {
  return core::SlotTable{indices.data_ptr<int32_t>(), locations.data_ptr<int32_t>(),
                         indices.size(0),           indices.size(1),
                         experts,                   capacity};
}

template <class T>
const core::acc_t<core_t<T>>* maybe_ptr_acc(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const core::acc_t<core_t<T>>*>(t.data_ptr()) : nullptr;
}

template <class T>
core::acc_t<core_t<T>>* maybe_out_acc(const at::Tensor& t) {
  return t.numel() > 0 ? reinterpret_cast<core::acc_t<core_t<T>>*>(t.data_ptr()) : nullptr;
}

template <class T>
const core_t<T>* maybe_data(const at::Tensor& t) {
  return t.defined() ? core_ptr<T>(t) : nullptr;
}

std::tuple<at::Tensor, at::Tensor> gather_slots_cpu(const at::Tensor& rows_in,
                                                    const at::Tensor& indices_in,
                                                    const at::Tensor& locations_in,
                                                    const c10::optional<at::Tensor>& weights_in,
                                                    const c10::optional<at::Tensor>& other_in) {
  const char* op = "gather_slots";
  check_dim(rows_in, 3, op, "rows");
  check_floating(rows_in, op, "rows");
  check_slot_table(indices_in, locations_in, op);
  const at::Tensor rows = rows_in.contiguous();
  const at::Tensor indices = indices_in.contiguous(), locations = locations_in.contiguous();
  const auto dtype = rows.scalar_type();
  const int64_t experts = rows.size(0), capacity = rows.size(1), M = rows.size(2);
  const int64_t tokens = indices.size(1);
  const at::Tensor weights = checked_weights(weights_in, indices, dtype, op);
  const at::Tensor other = checked_other(other_in, {tokens, M}, dtype, op);

  at::Tensor out = at::empty({tokens, M}, rows.options());
  at::Tensor dots = make_dots(other, indices, dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "tutel_dispatch", [&] {
    auto status = core::gather_slots(core_ptr<scalar_t>(rows), M,
                                     slot_table(indices, locations, experts, capacity),
                                     maybe_ptr_acc<scalar_t>(weights), maybe_data<scalar_t>(other),
                                     maybe_out_acc<scalar_t>(dots), core_ptr<scalar_t>(out));
    raise_if_failed(status, op);
  });
  return {out, dots};
}

std::tuple<at::Tensor, at::Tensor> scatter_slots_cpu(
    const at::Tensor& src_in, const at::Tensor& indices_in, const at::Tensor& locations_in,
    const c10::optional<at::Tensor>& weights_in, const c10::optional<at::Tensor>& other_in,
    int64_t experts, int64_t capacity) {
  const char* op = "scatter_slots";
  check_dim(src_in, 2, op, "src");
  check_floating(src_in, op, "src");
  check_slot_table(indices_in, locations_in, op);
  TORCH_CHECK_VALUE(experts >= 1, "tutel::", op, ": num_experts must be >= 1, got ", experts);
  TORCH_CHECK_VALUE(capacity >= 0, "tutel::", op, ": capacity must be >= 0, got ", capacity);
  const at::Tensor src = src_in.contiguous();
  const at::Tensor indices = indices_in.contiguous(), locations = locations_in.contiguous();
  TORCH_CHECK_VALUE(src.size(0) == indices.size(1), "tutel::", op, ": `src` has ", src.size(0),
                    " rows but `indices` describes ", indices.size(1), " tokens");
  const auto dtype = src.scalar_type();
  const int64_t M = src.size(1);
  const at::Tensor weights = checked_weights(weights_in, indices, dtype, op);
  const at::Tensor other = checked_other(other_in, {experts, capacity, M}, dtype, op);

  at::Tensor out = at::empty({experts, capacity, M}, src.options());
  at::Tensor dots = make_dots(other, indices, dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "tutel_dispatch", [&] {
    auto status = core::scatter_slots(core_ptr<scalar_t>(src), M,
                                      slot_table(indices, locations, experts, capacity),
                                      maybe_ptr_acc<scalar_t>(weights), maybe_data<scalar_t>(other),
                                      maybe_out_acc<scalar_t>(dots), core_ptr<scalar_t>(out));
    raise_if_failed(status, op);
  });
  return {out, dots};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("gather_slots", &gather_slots_cpu);
  m.impl("scatter_slots", &scatter_slots_cpu);
}

}  // namespace ops
}  // namespace tutel
