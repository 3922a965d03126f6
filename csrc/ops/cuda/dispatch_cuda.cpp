// CUDA implementations of gather_slots and scatter_slots (encode / decode and
// their backward passes); the kernels are in kernels/dispatch.cu.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <tuple>

#include "../../cuda/driver.h"
#include "../op_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const KernelFamily kGatherVector{"dispatch.cu", "gather_slots_vector"};
const KernelFamily kGatherScalar{"dispatch.cu", "gather_slots_scalar"};
const KernelFamily kScatterClaimSlots{"dispatch.cu", "scatter_claim_slots"};
const KernelFamily kScatterVector{"dispatch.cu", "scatter_slots_vector"};
const KernelFamily kScatterScalar{"dispatch.cu", "scatter_slots_scalar"};

// Vectors each lane of a row group handles per strip (TUTEL_UNROLL in dispatch.cu).
constexpr int64_t kUnroll = 4;

// How the row kernels walk a row of model_dim elements: 16-byte vectors when
// the row length and every row pointer allow it, and a group of 2^group_log2
// lanes per row, just enough to cover a row in one strip (at most a warp).
struct RowLayout {
  bool vector;
  int group_log2;
  int64_t rows_per_block() const { return TUTEL_BLOCK_THREADS >> group_log2; }
};

RowLayout row_layout(int64_t model_dim, int64_t element_size,
                     std::initializer_list<const at::Tensor*> row_tensors) {
  const int64_t width = 16 / element_size;
  bool vector = model_dim % width == 0;
  for (const at::Tensor* t : row_tensors)
    if (t->defined() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) vector = false;
  const int64_t vectors = vector ? model_dim / width : model_dim;
  const int64_t lanes_needed = (vectors + kUnroll - 1) / kUnroll;
  int group_log2 = 0;
  while (group_log2 < 5 && (int64_t(1) << group_log2) < lanes_needed) ++group_log2;
  return RowLayout{vector, group_log2};
}

std::tuple<at::Tensor, at::Tensor> gather_slots_cuda(const at::Tensor& rows,
                                                     const at::Tensor& indices,
                                                     const at::Tensor& locations,
                                                     const c10::optional<at::Tensor>& weights,
                                                     const c10::optional<at::Tensor>& other) {
  const SlotArgs a = gather_slots_args(rows, indices, locations, weights, other);
  check_choice_count(a.k, a.tokens, "gather_slots");
  CudaOpScope scope(a.data);
  at::Tensor out = at::empty({a.tokens, a.model_dim}, a.data.options());
  at::Tensor dots = make_dots(a);
  const RowLayout layout = row_layout(a.model_dim, a.data.element_size(), {&a.data, &a.other, &out});
  const KernelFamily& kernel = layout.vector ? kGatherVector : kGatherScalar;
  cuda::launch_kernel(kernel.get(scope.device(), data_variant(a.data.scalar_type())),
                      {cuda::blocks_for(a.tokens, layout.rows_per_block())}, scope.stream(),
                      "gather_slots", input_ptr(a.data), input_ptr(a.indices),
                      input_ptr(a.locations), input_ptr(a.weights), input_ptr(a.other),
                      output_ptr(dots), output_ptr(out), a.tokens, a.k, a.experts, a.capacity,
                      a.model_dim, layout.group_log2, scope.error_sink());
  return {out, dots};
}

std::tuple<at::Tensor, at::Tensor> scatter_slots_cuda(
    const at::Tensor& src, const at::Tensor& indices, const at::Tensor& locations,
    const c10::optional<at::Tensor>& weights, const c10::optional<at::Tensor>& other,
    int64_t experts, int64_t capacity) {
  const SlotArgs a = scatter_slots_args(src, indices, locations, weights, other, experts, capacity);
  check_choice_count(a.k, a.tokens, "scatter_slots");
  CudaOpScope scope(a.data);
  at::Tensor out = at::empty({a.experts, a.capacity, a.model_dim}, a.data.options());
  at::Tensor dots = make_dots(a);
  const int64_t slots = a.experts * a.capacity;
  const Variant variant = data_variant(a.data.scalar_type());

  // Who claims each slot (see dispatch.cu), zeroed on the stream.
  at::Tensor slot_table = at::empty({2 * slots + 1}, a.indices.options());
  cuda::check_driver(cuda::driver().cuMemsetD32Async(reinterpret_cast<cuda::CUdeviceptr>(slot_table.data_ptr()),
                                                     0, size_t(slot_table.numel()), scope.stream()),
                     "cuMemsetD32Async");
  cuda::launch_kernel(kScatterClaimSlots.get(scope.device(), variant),
                      {cuda::blocks_for(a.k * a.tokens, TUTEL_BLOCK_THREADS)}, scope.stream(),
                      "scatter_slots", input_ptr(a.indices), input_ptr(a.locations), a.tokens, a.k,
                      a.experts, a.capacity, output_ptr(slot_table), output_ptr(dots),
                      scope.error_sink());

  const RowLayout layout = row_layout(a.model_dim, a.data.element_size(), {&a.data, &a.other, &out});
  const KernelFamily& kernel = layout.vector ? kScatterVector : kScatterScalar;
  const int64_t blocks = cuda::blocks_for(slots, layout.rows_per_block());
  // Blocks that also sum slots claimed more than once, if there are any.
  const int64_t shared_blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, scope.multiprocessors()));
  cuda::launch_kernel(kernel.get(scope.device(), variant), {blocks}, scope.stream(), "scatter_slots",
                      input_ptr(a.data), input_ptr(a.indices), input_ptr(a.locations),
                      input_ptr(a.weights), input_ptr(a.other), output_ptr(dots), output_ptr(out),
                      a.tokens, a.k, a.experts, a.capacity, a.model_dim, layout.group_log2,
                      static_cast<const void*>(slot_table.data_ptr()), shared_blocks);
  return {out, dots};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) {
  m.impl("gather_slots", &gather_slots_cuda);
  m.impl("scatter_slots", &scatter_slots_cuda);
}

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
