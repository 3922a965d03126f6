// CUDA implementation of tutel::quantized_grouped_linear (kernels/quantized_grouped_linear.cu): rows
// grouped by expert times a quantized stack, the codes decoded tile by tile in shared memory and
// multiplied on the tensor cores.  One launch and no host synchronisation: the checks read only
// shapes and dtypes, the ends are read by the kernel (their clamped running maximum: values out of
// order are not reported, as the CPU operator does, since that would need them on the host), and
// the grid comes from the shapes.  Contiguous int32 ends, float32 (or no) bias and, for fp8_block,
// float32 scales are read as they are; int64 ends, a bias of another dtype and other fp8_block
// scales cost one conversion launch each before the kernel.  W8A8 (activation_group > 0) quantizes
// the rows inside the same launch.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#include "../../cuda/expert_launch_plan.h"
#include "../quantized_grouped_linear_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::quantized_grouped_linear_mxfp4> kMxfp4;
const Kernel<cuda::kernels::quantized_grouped_linear_nvfp4> kNvfp4;
const Kernel<cuda::kernels::quantized_grouped_linear_fp8_block> kFp8Block;

TutelQuantMatrix matrix_of(const QuantizedGroupedLinearArgs& a) {
  TutelQuantMatrix m{};
  m.codes = static_cast<const unsigned char*>(input_ptr(a.stack.codes));
  m.scales = input_ptr(a.stack.scales);
  m.global = a.stack.global.defined() ? static_cast<const float*>(input_ptr(a.stack.global)) : nullptr;
  m.rows = a.stack.rows;
  m.cols = a.stack.cols;
  m.block_rows = a.block_rows;
  m.block_cols = a.block_cols;
  return m;
}

at::Tensor quantized_grouped_linear_cuda(const at::Tensor& rows, const at::Tensor& ends, c10::string_view format,
                                         const at::Tensor& codes, const at::Tensor& scales,
                                         const c10::optional<at::Tensor>& global_scale, at::IntArrayRef block,
                                         const c10::optional<at::Tensor>& bias, int64_t activation_group) {
  const QuantizedGroupedLinearArgs a =
      quantized_grouped_linear_args(rows, ends, std::string(format), codes, scales, global_scale, block, bias,
                                    activation_group, /*read_ends=*/false);
  CudaOpScope scope(a.rows);
  const int64_t n = a.rows.size(0), outputs = a.stack.rows;
  at::Tensor out = at::empty({n, outputs}, a.rows.options());
  if (out.numel() == 0) return out;
  const at::Tensor ends32 = ends.to(at::kInt).contiguous();  // no launch for contiguous int32 ends
  const int64_t row_stride = n > 1 ? a.rows.stride(0) : a.stack.cols;
  const TutelQuantMatrix matrix = matrix_of(a);
  const Variant variant = data_variant(a.rows.scalar_type());
  const int device = scope.device();
  const auto kernel = a.format == core::QuantFormat::kMxfp4   ? kMxfp4.get(device, variant)
                      : a.format == core::QuantFormat::kNvfp4 ? kNvfp4.get(device, variant)
                                                              : kFp8Block.get(device, variant);
  const int64_t experts = a.experts;
  cuda::launch_kernel(kernel, cuda::plan_quantized_grouped_linear(n, experts, outputs), scope.stream(),
                      "quantized_grouped_linear", input_ptr(a.rows), row_stride,
                      static_cast<const int*>(input_ptr(ends32)), n, experts, matrix, input_ptr(a.bias),
                      output_ptr(out), a.activation_group);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) { m.impl("quantized_grouped_linear", &quantized_grouped_linear_cuda); }

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
