// decode_experts on CPU: decode_experts' own argument checks, then routed_gated_experts' CPU
// implementation, whose result decode_experts is defined to be (the same arguments, ids outside
// [0, E) dropped).  The CPU has no launches to save, and routed_gated_experts already runs the
// grouping, the grouped products (each active expert's matrices read once) and the weighted
// combine in one C++ call.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "../decode_experts_args.h"

namespace tutel {
namespace ops {
namespace {

using RoutedGatedExperts =
    at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&,
               const at::Tensor&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, bool, double,
               double, c10::optional<double>, bool, const c10::optional<at::Tensor>&);

c10::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

at::Tensor decode_experts_cpu(const at::Tensor& x, const at::Tensor& expert_ids,
                              const c10::optional<at::Tensor>& weights, const at::Tensor& up_weight,
                              const at::Tensor& down_weight, const c10::optional<at::Tensor>& up_bias,
                              const c10::optional<at::Tensor>& down_bias, bool transposed, double alpha,
                              double up_offset, c10::optional<double> limit, bool interleaved,
                              const c10::optional<at::Tensor>& gate_weight) {
  const DecodeExpertsArgs a = decode_experts_args(x, expert_ids, weights, up_weight, down_weight, up_bias, down_bias,
                                                  transposed, alpha, up_offset, limit, interleaved, gate_weight);
  // routed_gated_experts' implementation is private to its file: reach its CPU kernel through
  // the dispatcher, straight to the CPU key (no autograd or Python layers in between; decode_experts
  // has no gradient and the tensors here are real CPU tensors).
  static const auto routed = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("tutel::routed_gated_experts", "")
                                 .typed<RoutedGatedExperts>();
  return routed.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), a.x, a.expert_ids, optional_of(a.weights),
                           a.up_weight, a.down_weight, optional_of(a.up_bias), optional_of(a.down_bias), transposed,
                           alpha, up_offset, limit, interleaved, optional_of(a.gate_weight));
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) { m.impl("decode_experts", &decode_experts_cpu); }

}  // namespace ops
}  // namespace tutel
