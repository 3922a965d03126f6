// CUDA implementations of gather_slots and scatter_slots (encode / decode and
// their backward passes); the kernels are in kernels/dispatch.cu.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "../../cuda/driver.h"
#include "../op_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::gather_slots_vector> kGatherVector;
const Kernel<cuda::kernels::gather_slots_scalar> kGatherScalar;
const Kernel<cuda::kernels::scatter_claim_slots> kScatterClaimSlots;
const Kernel<cuda::kernels::scatter_slots_vector> kScatterVector;
const Kernel<cuda::kernels::scatter_slots_scalar> kScatterScalar;

static_assert(int(core::WeightType::kFloat32) == TUTEL_WEIGHTS_FLOAT32 &&
                  int(core::WeightType::kFloat64) == TUTEL_WEIGHTS_FLOAT64 &&
                  int(core::WeightType::kFloat16) == TUTEL_WEIGHTS_FLOAT16 &&
                  int(core::WeightType::kBFloat16) == TUTEL_WEIGHTS_BFLOAT16,
              "WeightType numbers the dtypes as kernel_abi.h");

// The weights as the kernels read them: in place, any floating dtype and strides.
TutelChoiceWeights kernel_weights(const at::Tensor& weights) {
  const core::ChoiceWeights w = choice_weights(weights);
  return TutelChoiceWeights{w.data, w.choice_stride, w.token_stride, int(w.type)};
}

// A row tensor's address for the launch plan (nullptr when absent).
const void* row_address(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

std::tuple<at::Tensor, at::Tensor> gather_slots_cuda(const at::Tensor& rows,
                                                     const c10::optional<at::Tensor>& indices,
                                                     const at::Tensor& locations,
                                                     const c10::optional<at::Tensor>& weights,
                                                     const c10::optional<at::Tensor>& other) {
  const SlotArgs a = gather_slots_args(rows, indices, locations, weights, other);
  check_choice_count(a.k, a.tokens, "gather_slots");
  CudaOpScope scope(a.data);
  at::Tensor out = at::empty({a.tokens, a.model_dim}, a.data.options());
  at::Tensor dots = make_dots(a);
  const cuda::GatherPlan plan =
      cuda::plan_gather(a.tokens, a.model_dim, a.data.element_size(),
                        {row_address(a.data), row_address(a.other), row_address(out)});
  const Variant variant = data_variant(a.data.scalar_type());
  const auto kernel = plan.layout.vector ? kGatherVector.get(scope.device(), variant)
                                         : kGatherScalar.get(scope.device(), variant);
  cuda::launch_kernel(kernel, plan.grid,
                      scope.stream(), "gather_slots", input_ptr(a.data), input_ptr(a.indices),
                      input_ptr(a.locations), kernel_weights(a.weights), input_ptr(a.other),
                      output_ptr(dots), output_ptr(out), a.tokens, a.k, a.experts, a.capacity,
                      a.model_dim, plan.layout.group_log2, scope.error_sink());
  return {out, dots};
}

std::tuple<at::Tensor, at::Tensor> scatter_slots_cuda(
    const at::Tensor& src, const c10::optional<at::Tensor>& indices, const at::Tensor& locations,
    const c10::optional<at::Tensor>& weights, const c10::optional<at::Tensor>& other,
    int64_t experts, int64_t capacity) {
  const SlotArgs a = scatter_slots_args(src, indices, locations, weights, other, experts, capacity);
  check_choice_count(a.k, a.tokens, "scatter_slots");
  CudaOpScope scope(a.data);
  at::Tensor out = at::empty({a.experts, a.capacity, a.model_dim}, a.data.options());
  at::Tensor dots = make_dots(a);
  const Variant variant = data_variant(a.data.scalar_type());
  // Grouped (no indices): the caller promises distinct locations, and the slot table
  // holds an owner per slot that the rows kernel trusts only where it points back
  // (see dispatch.cu), so the table needs no zeroing: two launches instead of three.
  const bool grouped = !a.indices.defined();
  const cuda::ScatterPlan plan =
      cuda::plan_scatter(a.tokens, a.k, a.experts, a.capacity, a.model_dim, a.data.element_size(),
                         scope.multiprocessors(),
                         {row_address(a.data), row_address(a.other), row_address(out)}, grouped);

  // Who claims each slot (see dispatch.cu), zeroed on the stream unless grouped.
  at::Tensor slot_table = at::empty({plan.slot_table_ints}, a.locations.options());
  if (!grouped)
    cuda::check_driver(cuda::driver().cuMemsetD32Async(reinterpret_cast<cuda::CUdeviceptr>(slot_table.data_ptr()),
                                                       0, size_t(slot_table.numel()), scope.stream()),
                       "cuMemsetD32Async");
  cuda::launch_kernel(kScatterClaimSlots.get(scope.device(), variant), plan.claim_grid,
                      scope.stream(), "scatter_slots", input_ptr(a.indices), input_ptr(a.locations),
                      a.tokens, a.k, a.experts, a.capacity, output_ptr(slot_table),
                      output_ptr(dots), scope.error_sink());
  const auto kernel = plan.layout.vector ? kScatterVector.get(scope.device(), variant)
                                         : kScatterScalar.get(scope.device(), variant);
  cuda::launch_kernel(kernel, plan.row_grid, scope.stream(),
                      "scatter_slots",
                      input_ptr(a.data), input_ptr(a.indices), input_ptr(a.locations),
                      kernel_weights(a.weights), input_ptr(a.other), output_ptr(dots), output_ptr(out),
                      a.tokens, a.k, a.experts, a.capacity, a.model_dim, plan.layout.group_log2,
                      static_cast<const void*>(slot_table.data_ptr()), plan.shared_blocks);
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
