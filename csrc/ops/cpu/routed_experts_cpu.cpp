// routed_gated_experts: the no-grad forward of tutel.experts.routed_experts for gated experts (and
// of moe_layer's llama_ffn experts, whose gate and up matrices are separate), in one operator
// call.  Step by step it is six operator calls with Python between them (grouping, the token rows'
// copy, two grouped products, the gated unit, the weighted combine), and at decoding sizes their
// fixed costs are a sizeable share of the time it takes to stream the active experts' weights; here
// the same CPU implementations run back to back in C++.
//
// The work around the products stays out of ATen's operators (the grouping into plain arrays, the
// rows scattered and gathered by core/dispatch.h, the routing weights read in place): with the
// caches cold after the weights streamed, every operator call through the dispatcher has a fixed
// cost, and at one token those costs were most of this operator's own time (docs/performance.md,
// "Routed experts on the CPU").  For the same reason tutel._C also binds the function directly,
// for eager CPU calls without autograd (tutel.experts.routed.routed_gated_experts_cpu).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/record_function.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <vector>

#include "../../core/dispatch.h"
#include "../checks.h"
#include "../core_types.h"
#include "../op_args.h"
#include "gated_units_cpu.h"
#include "grouped_linear_cpu.h"
#include "routing_cpu.h"
#include "reusable_buffers.h"

namespace tutel {
namespace ops {
namespace {

constexpr const char* kOp = "routed_gated_experts";

void check_arguments(const at::Tensor& x, const at::Tensor& expert_ids, const c10::optional<at::Tensor>& weights,
                     const at::Tensor& up_weight, const at::Tensor& down_weight,
                     const c10::optional<at::Tensor>& up_bias, const c10::optional<at::Tensor>& down_bias,
                     bool transposed, bool interleaved, const c10::optional<at::Tensor>& gate_weight) {
  check_dim(x, 2, kOp, "x");
  check_floating(x, kOp, "x");
  check_dim(expert_ids, 2, kOp, "expert_ids");
  TORCH_CHECK_TYPE(at::isIntegralType(expert_ids.scalar_type(), /*includeBool=*/false), "tutel::", kOp,
                   ": `expert_ids` must hold integers, got ", expert_ids.scalar_type());
  TORCH_CHECK_VALUE(expert_ids.size(0) == x.size(0), "tutel::", kOp, ": `expert_ids` must be [T, k] with T = ",
                    x.size(0), " rows of `x`, got ", expert_ids.sizes());
  TORCH_CHECK_VALUE(expert_ids.numel() < (int64_t(1) << 31), "tutel::", kOp,
                    ": at most 2^31 - 1 choices (int32 slots), got ", expert_ids.numel());
  if (weights.has_value()) {
    check_floating(*weights, kOp, "weights");
    TORCH_CHECK_VALUE(weights->sizes() == expert_ids.sizes(), "tutel::", kOp,
                      ": `weights` must have the shape of `expert_ids` ", expert_ids.sizes(), ", got ",
                      weights->sizes());
  }
  check_dim(up_weight, 3, kOp, "up_weight");
  check_dim(down_weight, 3, kOp, "down_weight");
  check_dtype(up_weight, x.scalar_type(), kOp, "up_weight");
  check_dtype(down_weight, x.scalar_type(), kOp, "down_weight");
  const int64_t experts = up_weight.size(0);
  TORCH_CHECK_VALUE(experts >= 1 && down_weight.size(0) == experts, "tutel::", kOp, ": `up_weight` holds ", experts,
                    " experts and `down_weight` ", down_weight.size(0), "; both must hold the same number >= 1");
  // [E, U, H] and [E, O, I] (F.linear layout), or [E, H, U] and [E, I, O] when transposed.
  const int64_t up_in = transposed ? up_weight.size(1) : up_weight.size(2);
  const int64_t up_out = transposed ? up_weight.size(2) : up_weight.size(1);
  const int64_t down_in = transposed ? down_weight.size(1) : down_weight.size(2);
  const int64_t down_out = transposed ? down_weight.size(2) : down_weight.size(1);
  TORCH_CHECK_VALUE(up_in == x.size(1), "tutel::", kOp, ": `up_weight` ", up_weight.sizes(),
                    (transposed ? " ([E, H, U])" : " ([E, U, H])"), " must take the ", x.size(1), " features of `x`");
  if (gate_weight.has_value()) {
    check_dtype(*gate_weight, x.scalar_type(), kOp, "gate_weight");
    TORCH_CHECK_VALUE(gate_weight->sizes() == up_weight.sizes(), "tutel::", kOp, ": `gate_weight` must have the shape ",
                      "of `up_weight` ", up_weight.sizes(), ", got ", gate_weight->sizes());
    TORCH_CHECK_VALUE(!interleaved && !up_bias.has_value(), "tutel::", kOp,
                      ": with a separate `gate_weight` the unit cannot be interleaved and there is no `up_bias`");
    TORCH_CHECK_VALUE(up_out == down_in, "tutel::", kOp, ": with a separate `gate_weight` the up projection's ",
                      up_out, " outputs must equal the down projection's ", down_in, " inputs");
  } else {
    TORCH_CHECK_VALUE(up_out == 2 * down_in, "tutel::", kOp, ": the up projection's ", up_out,
                      " outputs must be twice the down projection's ", down_in, " inputs (gate and up values)");
  }
  for (const auto& [name, bias, width] :
       {std::make_tuple("up_bias", up_bias, up_out), std::make_tuple("down_bias", down_bias, down_out)}) {
    if (!bias.has_value()) continue;
    check_dtype(*bias, x.scalar_type(), kOp, name);
    TORCH_CHECK_VALUE(bias->dim() == 2 && bias->size(0) == experts && bias->size(1) == width, "tutel::", kOp, ": `",
                      name, "` must be [", experts, ", ", width, "], got ", bias->sizes());
  }
  for (const at::Tensor& t : {x, expert_ids, weights.value_or(x), up_weight, down_weight, up_bias.value_or(x),
                              down_bias.value_or(x), gate_weight.value_or(x)})
    TORCH_CHECK_VALUE(t.device().is_cpu(), "tutel::", kOp, ": every tensor must be on the CPU, got one on ",
                      t.device());
}

at::Tensor routed_gated_experts_cpu(const at::Tensor& x, const at::Tensor& expert_ids,
                                    const c10::optional<at::Tensor>& weights, const at::Tensor& up_weight,
                                    const at::Tensor& down_weight, const c10::optional<at::Tensor>& up_bias,
                                    const c10::optional<at::Tensor>& down_bias, bool transposed, double alpha,
                                    double up_offset, c10::optional<double> limit, bool interleaved,
                                    const c10::optional<at::Tensor>& gate_weight) {
  check_arguments(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias, transposed, interleaved,
                  gate_weight);
  const int64_t tokens = x.size(0), k = expert_ids.size(1), choices = tokens * k, experts = up_weight.size(0);
  const int64_t features = x.size(1), outputs = transposed ? down_weight.size(2) : down_weight.size(1);
  // The choices sorted by expert; the kept ones (ids inside [0, E)) fill the first slots.  In
  // plain arrays: at decoding sizes each tensor allocation costs more than the grouping itself.
  std::vector<int32_t> locations(choices), ends(experts);
  std::vector<int64_t> slot_choices(choices), sorted_ids(choices), counts(experts);
  group_by_expert_into(expert_ids, experts, locations.data(), slot_choices.data(), sorted_ids.data(),
                       counts.data(), ends.data());
  const int64_t kept = ends[experts - 1];  // E >= 1 (checked)
  // The kept slots form one "expert" of capacity `kept` (dropped choices sit at location
  // T k >= kept): the token rows are scattered into it and the outputs gathered back from it
  // (no expert table: every choice's expert is 0).
  const core::SlotTable table{nullptr, locations.data(), k, tokens, 1, kept};
  const at::Tensor x_rows = x.contiguous();
  at::Tensor rows = empty_reusable({kept, features}, x.options());
  at::Tensor out = empty_reusable({tokens, outputs}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), kOp, [&] {
    raise_if_failed(core::scatter_slots<core_t<scalar_t>>(core_ptr<scalar_t>(x_rows), features, table, {},
                                                          nullptr, nullptr, core_ptr<scalar_t>(rows)),
                    kOp);
  });
  const at::IntArrayRef group_rows(counts);
  // grouped_linear's flag says the matrices are [O, K]: the F.linear layout, transposed = false.
  const at::Tensor up = grouped_linear_cpu(rows, up_weight, up_bias, group_rows, !transposed);
  const at::Tensor unit =
      gate_weight.has_value()
          ? gated_unit_pair_cpu(grouped_linear_cpu(rows, *gate_weight, c10::nullopt, group_rows, !transposed), up,
                                alpha, up_offset, limit)
          : gated_unit_cpu(up, alpha, up_offset, limit, interleaved);
  const at::Tensor hidden = grouped_linear_cpu(unit, down_weight, down_bias, group_rows, !transposed);
  // The [T, k] weights read in place as [k, T] (any floating dtype and strides).
  const core::ChoiceWeights gates = weights.has_value() ? choice_weights(weights->t()) : core::ChoiceWeights{};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), kOp, [&] {
    raise_if_failed(core::gather_slots<core_t<scalar_t>>(core_ptr<scalar_t>(hidden), outputs, table, gates,
                                                         nullptr, nullptr, core_ptr<scalar_t>(out)),
                    kOp);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) { m.impl("routed_gated_experts", &routed_gated_experts_cpu); }

void register_routed_experts_function(pybind11::module_& m) {
  m.def(
      "routed_gated_experts",
      [](const at::Tensor& x, const at::Tensor& expert_ids, const c10::optional<at::Tensor>& weights,
         const at::Tensor& up_weight, const at::Tensor& down_weight, const c10::optional<at::Tensor>& up_bias,
         const c10::optional<at::Tensor>& down_bias, bool transposed, double alpha, double up_offset,
         c10::optional<double> limit, bool interleaved, const c10::optional<at::Tensor>& gate_weight) {
        // Profiles name the call as they name the operator's (nothing happens unless one records).
        RECORD_FUNCTION("tutel::routed_gated_experts", std::vector<c10::IValue>());
        return routed_gated_experts_cpu(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias,
                                        transposed, alpha, up_offset, limit, interleaved, gate_weight);
      },
      "tutel::routed_gated_experts' CPU implementation, called without the dispatcher: for plain CPU tensors "
      "without autograd, outside any Python dispatch mode (tutel.experts.routed.routed_gated_experts_cpu).",
      // the operator's schema, defaults included (schemas.cpp)
      pybind11::arg("x"), pybind11::arg("expert_ids"), pybind11::arg("weights"), pybind11::arg("up_weight"),
      pybind11::arg("down_weight"), pybind11::arg("up_bias"), pybind11::arg("down_bias"), pybind11::arg("transposed"),
      pybind11::arg("alpha"), pybind11::arg("up_offset"), pybind11::arg("limit"), pybind11::arg("interleaved"),
      pybind11::arg("gate_weight") = pybind11::none());
}

}  // namespace ops
}  // namespace tutel
