// CUDA implementation of tutel::decode_experts (kernels/decode_experts.cu): the gate/up kernel
// (the gated unit applied in registers, into an [T k, I] scratch in the accumulation type), then
// the down kernel (each token's weighted sum over its choices written once).  Two launches and
// no host synchronisation: the expert ids and routing weights are read on the device as they
// are (int32 / int64 ids, weights of any floating dtype, any strides), and every size comes from
// the shapes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../../cuda/expert_launch_plan.h"
#include "../decode_experts_args.h"
#include "cuda_op.h"
#include "decode_routing_cuda.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::decode_gate_up_rows_vector> kGateUpRowsVector;
const Kernel<cuda::kernels::decode_gate_up_rows_scalar> kGateUpRowsScalar;
const Kernel<cuda::kernels::decode_gate_up_columns_vector> kGateUpColumnsVector;
const Kernel<cuda::kernels::decode_gate_up_columns_scalar> kGateUpColumnsScalar;
const Kernel<cuda::kernels::decode_down_rows_vector> kDownRowsVector;
const Kernel<cuda::kernels::decode_down_rows_scalar> kDownRowsScalar;
const Kernel<cuda::kernels::decode_down_columns_vector> kDownColumnsVector;
const Kernel<cuda::kernels::decode_down_columns_scalar> kDownColumnsScalar;

at::Tensor decode_experts_cuda(const at::Tensor& x, const at::Tensor& expert_ids,
                               const c10::optional<at::Tensor>& weights, const at::Tensor& up_weight,
                               const at::Tensor& down_weight, const c10::optional<at::Tensor>& up_bias,
                               const c10::optional<at::Tensor>& down_bias, bool transposed, double alpha,
                               double up_offset, c10::optional<double> limit, bool interleaved,
                               const c10::optional<at::Tensor>& gate_weight) {
  const DecodeExpertsArgs a = decode_experts_args(x, expert_ids, weights, up_weight, down_weight, up_bias,
                                                  down_bias, transposed, alpha, up_offset, limit, interleaved,
                                                  gate_weight);
  CudaOpScope scope(a.x);
  at::Tensor out = at::empty({a.tokens, a.outputs}, a.x.options());
  if (out.numel() == 0) return out;
  if (a.k == 0) return out.zero_();  // no choices: every token's sum is empty (no kernel grid)
  const cuda::DecodePlan plan = cuda::plan_decode_experts(
      a.tokens, a.k, a.hidden, a.inter, a.outputs, transposed, a.x.element_size(), input_ptr(a.x), a.x.stride(0),
      {input_ptr(a.up_weight), input_ptr(a.gate_weight)}, input_ptr(a.down_weight));
  // Scratch from PyTorch's caching allocator (no launch): h and y in the accumulation type, and
  // the down kernel's per-(token, tile) counters, which the gate/up kernel zeroes.
  const auto acc = a.x.options().dtype(a.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  const at::Tensor h = at::empty({a.tokens * a.k, a.inter}, acc);
  const at::Tensor y = at::empty({a.tokens * a.k, a.outputs}, acc);
  const at::Tensor counters = at::empty({plan.counter_ints}, a.x.options().dtype(at::kInt));
  const TutelDecodeRouting routing = decode_routing(a.expert_ids, a.weights, a.tokens, a.k, a.experts);
  const TutelDecodeUnit unit{alpha, up_offset, limit.value_or(0.0), int(limit.has_value()), int(interleaved)};
  const Variant variant = data_variant(a.x.scalar_type());
  const int device = scope.device();
  // The four kernels of each step take the same parameters: one checked function type.
  const auto gate_up = transposed ? (plan.gate_up_vector ? kGateUpColumnsVector.get(device, variant)
                                                         : kGateUpColumnsScalar.get(device, variant))
                                  : (plan.gate_up_vector ? kGateUpRowsVector.get(device, variant)
                                                         : kGateUpRowsScalar.get(device, variant));
  const auto down = transposed ? (plan.down_vector ? kDownColumnsVector.get(device, variant)
                                                   : kDownColumnsScalar.get(device, variant))
                               : (plan.down_vector ? kDownRowsVector.get(device, variant)
                                                   : kDownRowsScalar.get(device, variant));
  const int64_t x_stride = a.x.stride(0), hidden = a.hidden, inter = a.inter, outputs = a.outputs;
  const int64_t counter_count = plan.counter_ints;
  cuda::launch_kernel(gate_up, plan.gate_up_grid, scope.stream(),
                      "decode_experts (gate/up)", input_ptr(a.x), x_stride, routing, input_ptr(a.up_weight),
                      input_ptr(a.gate_weight), input_ptr(a.up_bias), hidden, inter, unit, output_ptr(h),
                      output_ptr(counters), counter_count, output_ptr(out), outputs);
  cuda::launch_kernel(down, plan.down_grid, scope.stream(), "decode_experts (down)",
                      input_ptr(h), routing, input_ptr(a.down_weight), input_ptr(a.down_bias), inter, outputs,
                      output_ptr(y), output_ptr(counters), output_ptr(out));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) { m.impl("decode_experts", &decode_experts_cuda); }

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
