// CUDA implementation of tutel::decode_quantized_experts (kernels/quantized_decode.cu): the
// gate/up kernel (codes decoded in registers, the unit applied, into an [T k, I] float32
// scratch), then the down kernel (each token's weighted sum over its choices written once).  Two
// launches and no host synchronisation: the checks read only shapes and dtypes, the expert ids
// and routing weights are read on the device, and every size comes from the shapes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#include "../../cuda/expert_launch_plan.h"
#include "../decode_quantized_experts_args.h"
#include "cuda_op.h"
#include "decode_routing_cuda.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::quantized_gate_up_mxfp4_vector> kGateUpMxfp4Vector;
const Kernel<cuda::kernels::quantized_gate_up_mxfp4_scalar> kGateUpMxfp4Scalar;
const Kernel<cuda::kernels::quantized_gate_up_nvfp4_vector> kGateUpNvfp4Vector;
const Kernel<cuda::kernels::quantized_gate_up_nvfp4_scalar> kGateUpNvfp4Scalar;
const Kernel<cuda::kernels::quantized_gate_up_fp8_block_vector> kGateUpFp8Vector;
const Kernel<cuda::kernels::quantized_gate_up_fp8_block_scalar> kGateUpFp8Scalar;
const Kernel<cuda::kernels::quantized_down_mxfp4_vector> kDownMxfp4Vector;
const Kernel<cuda::kernels::quantized_down_mxfp4_scalar> kDownMxfp4Scalar;
const Kernel<cuda::kernels::quantized_down_nvfp4_vector> kDownNvfp4Vector;
const Kernel<cuda::kernels::quantized_down_nvfp4_scalar> kDownNvfp4Scalar;
const Kernel<cuda::kernels::quantized_down_fp8_block_vector> kDownFp8Vector;
const Kernel<cuda::kernels::quantized_down_fp8_block_scalar> kDownFp8Scalar;

// The kernels' number for a format and a unit (expert_abi.h), as the core's enums number them.
int format_code(core::QuantFormat format) {
  switch (format) {
    case core::QuantFormat::kMxfp4: return TUTEL_QUANT_MXFP4;
    case core::QuantFormat::kNvfp4: return TUTEL_QUANT_NVFP4;
    default: return TUTEL_QUANT_FP8_BLOCK;
  }
}

int activation_code(core::ExpertActivation activation) {
  switch (activation) {
    case core::ExpertActivation::kGelu: return TUTEL_UNIT_GELU;
    case core::ExpertActivation::kGeluTanh: return TUTEL_UNIT_GELU_TANH;
    case core::ExpertActivation::kRelu: return TUTEL_UNIT_RELU;
    default: return TUTEL_UNIT_GATED;
  }
}

TutelQuantMatrix matrix_of(const DecodeQuantizedExpertsArgs& a, const QuantizedStackArgs& s) {
  TutelQuantMatrix m{};
  m.codes = static_cast<const unsigned char*>(input_ptr(s.codes));
  m.scales = input_ptr(s.scales);
  m.global = s.global.defined() ? static_cast<const float*>(input_ptr(s.global)) : nullptr;
  m.rows = s.rows;
  m.cols = s.cols;
  m.block_rows = a.block_rows;
  m.block_cols = a.block_cols;
  return m;
}

// The kernel of a step for the call's format and chunk width (one checked function type each).
template <class VectorKernel, class ScalarKernel>
auto pick(const VectorKernel& vector, const ScalarKernel& scalar, bool use_vector, int device, Variant variant) {
  return use_vector ? vector.get(device, variant) : scalar.get(device, variant);
}

at::Tensor decode_quantized_experts_cuda(
    const at::Tensor& x, const at::Tensor& expert_ids, const c10::optional<at::Tensor>& weights,
    c10::string_view format, const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
    const c10::optional<at::Tensor>& gate_up_global, const at::Tensor& down, const at::Tensor& down_scales,
    const c10::optional<at::Tensor>& down_global, at::IntArrayRef block, const c10::optional<at::Tensor>& gate_up_bias,
    const c10::optional<at::Tensor>& down_bias, c10::string_view activation, double alpha, double up_offset,
    c10::optional<double> limit, bool interleaved) {
  const DecodeQuantizedExpertsArgs a = decode_quantized_experts_args(
      x, expert_ids, weights, std::string(format), gate_up, gate_up_scales, gate_up_global, down, down_scales,
      down_global, block, gate_up_bias, down_bias, std::string(activation), alpha, up_offset, limit, interleaved,
      /*routing_as_given=*/true);
  CudaOpScope scope(a.x);
  at::Tensor out = at::empty({a.tokens, a.outputs}, a.x.options());
  if (out.numel() == 0) return out;
  if (a.k == 0) return out.zero_();  // no choices: every token's sum is empty (no kernel grid)
  check_choice_count(a.k, a.tokens, "decode_quantized_experts");
  const int fmt = format_code(a.format);
  const int64_t x_stride = a.tokens > 1 ? a.x.stride(0) : a.hidden;
  const cuda::DecodePlan plan = cuda::plan_quantized_decode(
      a.tokens, a.k, a.hidden, a.inter, a.outputs, fmt, a.block_cols, a.x.element_size(), input_ptr(a.x), x_stride,
      input_ptr(a.gate_up.codes), input_ptr(a.down.codes));
  // Scratch from PyTorch's caching allocator (no launch): h and y in float32, and the down
  // kernel's per-(token, tile) counters, which the gate/up kernel zeroes.
  const auto float32 = a.x.options().dtype(at::kFloat);
  const at::Tensor h = at::empty({a.tokens * a.k, a.inter}, float32);
  const at::Tensor y = at::empty({a.tokens * a.k, a.outputs}, float32);
  const at::Tensor counters = at::empty({plan.counter_ints}, a.x.options().dtype(at::kInt));
  const TutelDecodeRouting routing = decode_routing(a.expert_ids, a.weights, a.tokens, a.k, a.experts);
  const core::GatedUnit& gated = a.unit.gated;
  const TutelDecodeUnit unit{gated.alpha, gated.up_offset, gated.limit, int(gated.clamped), int(gated.interleaved)};
  const int unit_activation = activation_code(a.unit.activation);
  const TutelQuantMatrix gate_up_matrix = matrix_of(a, a.gate_up), down_matrix = matrix_of(a, a.down);
  const Variant variant = data_variant(a.x.scalar_type());
  const int device = scope.device();
  const bool gv = plan.gate_up_vector, dv = plan.down_vector;
  const auto gate_up_kernel =
      fmt == TUTEL_QUANT_MXFP4   ? pick(kGateUpMxfp4Vector, kGateUpMxfp4Scalar, gv, device, variant)
      : fmt == TUTEL_QUANT_NVFP4 ? pick(kGateUpNvfp4Vector, kGateUpNvfp4Scalar, gv, device, variant)
                                 : pick(kGateUpFp8Vector, kGateUpFp8Scalar, gv, device, variant);
  const auto down_kernel = fmt == TUTEL_QUANT_MXFP4   ? pick(kDownMxfp4Vector, kDownMxfp4Scalar, dv, device, variant)
                           : fmt == TUTEL_QUANT_NVFP4 ? pick(kDownNvfp4Vector, kDownNvfp4Scalar, dv, device, variant)
                                                      : pick(kDownFp8Vector, kDownFp8Scalar, dv, device, variant);
  const int64_t inter = a.inter, outputs = a.outputs, counter_count = plan.counter_ints;
  cuda::launch_kernel(gate_up_kernel, plan.gate_up_grid, scope.stream(), "decode_quantized_experts (gate/up)",
                      input_ptr(a.x), x_stride, routing, gate_up_matrix, input_ptr(a.gate_up_bias), inter, unit,
                      unit_activation, output_ptr(h), output_ptr(counters), counter_count, output_ptr(out), outputs);
  cuda::launch_kernel(down_kernel, plan.down_grid, scope.stream(), "decode_quantized_experts (down)", input_ptr(h),
                      routing, down_matrix, input_ptr(a.down_bias), inter, outputs, output_ptr(y),
                      output_ptr(counters), output_ptr(out));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) { m.impl("decode_quantized_experts", &decode_quantized_experts_cuda); }

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
