// CUDA implementation of cumsum_sub_one (kernels/cumsum.cu): chunk totals, a
// scan of them per column, and a scan of each chunk; three launches.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../op_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::cumsum_chunk_totals> kChunkTotals;
const Kernel<cuda::kernels::cumsum_chunk_offsets> kChunkOffsets;
const Kernel<cuda::kernels::cumsum_chunk_scan> kChunkScan;

at::Tensor cumsum_sub_one_cuda(const at::Tensor& mask_in) {
  const char* op = "cumsum_sub_one";
  check_dim(mask_in, 2, op, "mask");
  const at::Tensor mask = mask_in.contiguous();
  at::Tensor out = at::empty(mask.sizes(), mask.options().dtype(cumsum_output_dtype(mask.scalar_type())));
  const int64_t rows = mask.size(0), cols = mask.size(1);
  if (rows == 0 || cols == 0) return out;
  CudaOpScope scope(mask);
  const Variant variant = mask_variant(mask.scalar_type());
  const cuda::CumsumPlan plan = cuda::plan_cumsum(rows, cols);
  at::Tensor totals = at::empty({plan.chunks, cols}, out.options());
  cuda::launch_kernel(kChunkTotals.get(scope.device(), variant), plan.chunk_grid, scope.stream(),
                      "cumsum_sub_one", input_ptr(mask), rows, cols, plan.chunk_rows,
                      output_ptr(totals));
  cuda::launch_kernel(kChunkOffsets.get(scope.device(), variant), plan.offsets_grid, scope.stream(),
                      "cumsum_sub_one", output_ptr(totals), plan.chunks, cols);
  cuda::launch_kernel(kChunkScan.get(scope.device(), variant), plan.chunk_grid, scope.stream(),
                      "cumsum_sub_one", input_ptr(mask), rows, cols, plan.chunk_rows,
                      input_ptr(totals), output_ptr(out));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) { m.impl("cumsum_sub_one", &cumsum_sub_one_cuda); }

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
