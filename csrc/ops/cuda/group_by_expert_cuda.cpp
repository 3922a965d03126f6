// CUDA implementation of group_by_expert (the dropless grouping of routed choices): the
// counting sort of kernels/group_by_expert.cu in two launches, with no host synchronisation
// (every size comes from the shapes and num_experts).  int32 and int64 ids are read in place
// through their strides, so a transposed view costs no copy; narrower integers are widened to
// int64 first (one more launch), as on the CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "../group_by_expert_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::count_expert_choices> kCountExpertChoices;
const Kernel<cuda::kernels::place_expert_choices> kPlaceExpertChoices;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_by_expert_cuda(
    const at::Tensor& expert_ids, int64_t experts) {
  const at::Tensor ids = checked_group_by_expert_ids(expert_ids, experts);
  const int64_t tokens = ids.size(0), k = ids.size(1), choices = tokens * k;
  CudaOpScope scope(ids);
  const auto options = ids.options();
  at::Tensor locations = at::empty({k, tokens}, options.dtype(at::kInt));
  at::Tensor slot_choices = at::empty({choices}, options.dtype(at::kLong));
  at::Tensor sorted_ids = at::empty({choices}, options.dtype(at::kLong));
  at::Tensor counts = at::empty({experts}, options.dtype(at::kLong));
  at::Tensor ends = at::empty({experts}, options.dtype(at::kInt));
  const cuda::GroupByExpertPlan plan = cuda::plan_group_by_expert(tokens, k, experts);
  // One allocation for the count rows, the chunks' next slots and (beyond
  // TUTEL_GROUP_SHARED_BUCKETS experts) the blocks' bucket starts; the kernels write every
  // entry before reading it, so nothing is zeroed.
  at::Tensor scratch = at::empty({2 * plan.table_ints + plan.bucket_scratch_ints}, options.dtype(at::kInt));
  int* count_table = static_cast<int*>(output_ptr(scratch));
  int* next_table = plan.table_ints > 0 ? count_table + plan.table_ints : nullptr;
  int* bucket_scratch = plan.bucket_scratch_ints > 0 ? count_table + 2 * plan.table_ints : nullptr;
  const void* id_data = input_ptr(ids);
  const int ids_64bit = ids.scalar_type() == at::kLong ? 1 : 0;
  const int64_t token_stride = ids.stride(0), choice_stride = ids.stride(1);
  cuda::launch_kernel(kCountExpertChoices.get(scope.device()), plan.count_grid, scope.stream(), "group_by_expert",
                      id_data, ids_64bit, token_stride, choice_stride, tokens, k, experts, plan.chunk_choices,
                      plan.chunks, count_table);
  cuda::launch_kernel(kPlaceExpertChoices.get(scope.device()), plan.place_grid, scope.stream(), "group_by_expert",
                      id_data, ids_64bit, token_stride, choice_stride, tokens, k, experts, plan.chunk_choices,
                      plan.chunks, static_cast<const int*>(count_table), next_table, bucket_scratch,
                      output_ptr(locations), output_ptr(slot_choices), output_ptr(sorted_ids), output_ptr(counts),
                      output_ptr(ends));
  return {locations, slot_choices, sorted_ids, counts, ends};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) { m.impl("group_by_expert", &group_by_expert_cuda); }

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
