// CUDA implementation of cumsum_sub_one (kernels/cumsum.cu): chunk totals, a
// scan of them per column, and a scan of each chunk; three launches.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "../op_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const KernelFamily kChunkTotals{"cumsum.cu", "cumsum_chunk_totals"};
const KernelFamily kChunkOffsets{"cumsum.cu", "cumsum_chunk_offsets"};
const KernelFamily kChunkScan{"cumsum.cu", "cumsum_chunk_scan"};

// Rows per chunk: 128, or more so that the chunks fit the grid's y extent.
constexpr int64_t kChunkRows = 128;
constexpr int64_t kMaxGridY = 65535;

at::Tensor cumsum_sub_one_cuda(const at::Tensor& mask_in) {
  const char* op = "cumsum_sub_one";
  check_dim(mask_in, 2, op, "mask");
  const at::Tensor mask = mask_in.contiguous();
  at::Tensor out = at::empty(mask.sizes(), mask.options().dtype(cumsum_output_dtype(mask.scalar_type())));
  const int64_t rows = mask.size(0), cols = mask.size(1);
  if (rows == 0 || cols == 0) return out;
  CudaOpScope scope(mask);
  const Variant variant = mask_variant(mask.scalar_type());
  const int64_t chunk_rows = std::max(kChunkRows, cuda::blocks_for(rows, kMaxGridY));
  const int64_t chunks = cuda::blocks_for(rows, chunk_rows);
  at::Tensor totals = at::empty({chunks, cols}, out.options());
  const cuda::Grid columns_by_chunks{cuda::blocks_for(cols, TUTEL_BLOCK_THREADS), chunks};
  cuda::launch_kernel(kChunkTotals.get(scope.device(), variant), columns_by_chunks, scope.stream(),
                      "cumsum_sub_one", input_ptr(mask), rows, cols, chunk_rows, output_ptr(totals));
  cuda::launch_kernel(kChunkOffsets.get(scope.device(), variant),
                      {cuda::blocks_for(cols * 32, TUTEL_BLOCK_THREADS)}, scope.stream(),
                      "cumsum_sub_one", output_ptr(totals), chunks, cols);
  cuda::launch_kernel(kChunkScan.get(scope.device(), variant), columns_by_chunks, scope.stream(),
                      "cumsum_sub_one", input_ptr(mask), rows, cols, chunk_rows,
                      input_ptr(totals), output_ptr(out));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) { m.impl("cumsum_sub_one", &cumsum_sub_one_cuda); }

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
