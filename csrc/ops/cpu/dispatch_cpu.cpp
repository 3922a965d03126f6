// CPU implementations of gather_slots and scatter_slots (encode / decode and
// their backward passes).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <tuple>

#include "../../core/dispatch.h"
#include "../core_types.h"
#include "../op_args.h"
#include "reusable_buffers.h"

namespace tutel {
namespace ops {
namespace {

// Undefined indices (the grouped layout) become a null table: every choice's expert is 0.
core::SlotTable slot_table(const SlotArgs& a) {
  return core::SlotTable{a.indices.defined() ? a.indices.data_ptr<int32_t>() : nullptr,
                         a.locations.data_ptr<int32_t>(), a.k, a.tokens, a.experts, a.capacity};
}

template <class T>
core::acc_t<core_t<T>>* maybe_out_acc(const at::Tensor& t) {
  return t.numel() > 0 ? reinterpret_cast<core::acc_t<core_t<T>>*>(t.data_ptr()) : nullptr;
}

template <class T>
const core_t<T>* maybe_data(const at::Tensor& t) {
  return t.defined() ? core_ptr<T>(t) : nullptr;
}

// Runs `kernel` (core::gather_slots or core::scatter_slots) on checked arguments.
template <class Kernel>
std::tuple<at::Tensor, at::Tensor> run_slots(const SlotArgs& a, at::Tensor out, const char* op,
                                             Kernel kernel) {
  at::Tensor dots = make_dots(a);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.data.scalar_type(), "tutel_dispatch", [&] {
    auto status = kernel(core_ptr<scalar_t>(a.data), a.model_dim, slot_table(a),
                         choice_weights(a.weights), maybe_data<scalar_t>(a.other),
                         maybe_out_acc<scalar_t>(dots), core_ptr<scalar_t>(out));
    raise_if_failed(status, op);
  });
  return {out, dots};
}

std::tuple<at::Tensor, at::Tensor> gather_slots_cpu(const at::Tensor& rows,
                                                    const c10::optional<at::Tensor>& indices,
                                                    const at::Tensor& locations,
                                                    const c10::optional<at::Tensor>& weights,
                                                    const c10::optional<at::Tensor>& other) {
  const SlotArgs a = gather_slots_args(rows, indices, locations, weights, other);
  at::Tensor out = empty_reusable({a.tokens, a.model_dim}, a.data.options());
  return run_slots(a, out, "gather_slots", [](auto... args) { return core::gather_slots(args...); });
}

std::tuple<at::Tensor, at::Tensor> scatter_slots_cpu(
    const at::Tensor& src, const c10::optional<at::Tensor>& indices, const at::Tensor& locations,
    const c10::optional<at::Tensor>& weights, const c10::optional<at::Tensor>& other,
    int64_t experts, int64_t capacity) {
  const SlotArgs a = scatter_slots_args(src, indices, locations, weights, other, experts, capacity);
  at::Tensor out = empty_reusable({a.experts, a.capacity, a.model_dim}, a.data.options());
  return run_slots(a, out, "scatter_slots", [](auto... args) { return core::scatter_slots(args...); });
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("gather_slots", &gather_slots_cpu);
  m.impl("scatter_slots", &scatter_slots_cpu);
}

}  // namespace ops
}  // namespace tutel
