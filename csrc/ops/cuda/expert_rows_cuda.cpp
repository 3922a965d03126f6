// CUDA implementations of add_expert_bias_, expert_row_sums and choice_rows: one launch of
// kernels/expert_rows.cu each, no host synchronisation (every size comes from the shapes and k;
// `offsets` and the slot choices are read by the kernels only, which never step outside the
// tensors whatever they hold).  Row-strided views are read (and, for the bias, written) in place;
// the outputs are new contiguous tensors.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../expert_rows_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::add_expert_bias> kAddExpertBias;
const Kernel<cuda::kernels::expert_row_sums> kExpertRowSums;
const Kernel<cuda::kernels::choice_rows> kChoiceRows;

const int* ends_ptr(const at::Tensor& offsets) { return static_cast<const int*>(input_ptr(offsets)); }

void add_expert_bias_cuda(const at::Tensor& rows, const at::Tensor& bias_in, const at::Tensor& offsets_in) {
  const char* op = "add_expert_bias_";
  const ExpertBias checked = checked_add_expert_bias(rows, bias_in, offsets_in);
  const at::Tensor &bias = checked.bias, &offsets = checked.offsets;
  const int64_t n = rows.size(0), columns = rows.size(1), experts = offsets.size(0);
  if (experts == 0) return;  // every row lies past the (absent) experts' rows
  CudaOpScope scope(rows);
  const int64_t row_stride = rows.stride(0), bias_stride = bias.stride(0);
  const cuda::ExpertRowsPlan plan = cuda::plan_expert_rows(
      n, columns, rows.element_size(), {output_ptr(rows), input_ptr(bias)}, {row_stride, bias_stride});
  cuda::launch_kernel(kAddExpertBias.get(scope.device(), data_variant(rows.scalar_type())), plan.grid, scope.stream(),
                      op, output_ptr(rows), row_stride, input_ptr(bias), bias_stride, ends_ptr(offsets), experts, n,
                      columns, plan.vector ? 1 : 0);
}

at::Tensor expert_row_sums_cuda(const at::Tensor& rows_in, const at::Tensor& offsets_in) {
  const char* op = "expert_row_sums";
  const GroupedRows checked = checked_expert_row_sums(rows_in, offsets_in);
  const at::Tensor &rows = checked.rows, &offsets = checked.offsets;
  const int64_t n = rows.size(0), columns = rows.size(1), experts = offsets.size(0);
  at::Tensor out = at::empty({experts, columns}, rows.options());
  CudaOpScope scope(rows);
  cuda::launch_kernel(kExpertRowSums.get(scope.device(), data_variant(rows.scalar_type())),
                      cuda::plan_expert_row_sums(experts, columns), scope.stream(), op, input_ptr(rows),
                      rows.stride(0), ends_ptr(offsets), experts, n, columns, output_ptr(out));
  return out;
}

at::Tensor choice_rows_cuda(const at::Tensor& x_in, const at::Tensor& slot_choices_in, int64_t k) {
  const char* op = "choice_rows";
  const ChoiceRows checked = checked_choice_rows(x_in, slot_choices_in, k);
  const at::Tensor &x = checked.x, &slot_choices = checked.slot_choices;
  const int64_t tokens = x.size(0), columns = x.size(1), slots = slot_choices.size(0);
  at::Tensor out = at::empty({slots, columns}, x.options());
  CudaOpScope scope(x);
  const int64_t x_stride = x.stride(0);
  const cuda::ExpertRowsPlan plan =
      cuda::plan_expert_rows(slots, columns, x.element_size(), {input_ptr(x), output_ptr(out)}, {x_stride});
  cuda::launch_kernel(kChoiceRows.get(scope.device(), data_variant(x.scalar_type())), plan.grid, scope.stream(), op,
                      input_ptr(x), x_stride, tokens, static_cast<const int64_t*>(input_ptr(slot_choices)), k, slots,
                      columns, output_ptr(out), plan.vector ? 1 : 0);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) {
  m.impl("add_expert_bias_", &add_expert_bias_cuda);
  m.impl("expert_row_sums", &expert_row_sums_cuda);
  m.impl("choice_rows", &choice_rows_cuda);
}

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
