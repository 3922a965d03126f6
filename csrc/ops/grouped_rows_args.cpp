#include "grouped_rows_args.h"

#include "checks.h"
#include "core_types.h"

namespace tutel {
namespace ops {

GroupedRowsArgs checked_grouped_rows(const char* op, const at::Tensor& rows, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias, const at::Tensor& offsets,
                                     bool transposed) {
  check_dim(rows, 2, op, "rows");
  check_floating(rows, op, "rows");
  check_dim(weight, 3, op, "weight");
  check_dtype(weight, rows.scalar_type(), op, "weight");
  check_same_device(rows, weight, op, "weight");
  GroupedRowsArgs a;
  a.rows_count = rows.size(0);
  a.experts = weight.size(0);
  a.depth = transposed ? weight.size(1) : weight.size(2);
  a.outputs = transposed ? weight.size(2) : weight.size(1);
  TORCH_CHECK_VALUE(a.experts >= 1, "tutel::", op, ": `weight` must hold at least one expert, got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(a.depth == rows.size(1), "tutel::", op, ": `weight` ", weight.sizes(),
                    (transposed ? " ([E, K, O])" : " ([E, O, K])"), " must take the ", rows.size(1),
                    " features of `rows`");
  a.offsets = checked_offsets(offsets, rows, op);
  TORCH_CHECK_VALUE(offsets.size(0) == a.experts, "tutel::", op, ": `offsets` must have one end per expert ([",
                    a.experts, "]), got shape ", offsets.sizes());
  if (bias.has_value()) {
    check_dtype(*bias, rows.scalar_type(), op, "bias");
    check_same_device(rows, *bias, op, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 2 && bias->size(0) == a.experts && bias->size(1) == a.outputs, "tutel::", op,
                      ": `bias` must have shape [E, O] = [", a.experts, ", ", a.outputs, "], got ", bias->sizes());
    a.bias = bias->contiguous();
  }
  a.rows = rows_with_unit_stride(rows);
  a.weight = weight.contiguous();
  return a;
}

at::Tensor checked_grouped_rows_grad(const char* op, const at::Tensor& grad, const GroupedRowsArgs& args) {
  check_dtype(grad, args.rows.scalar_type(), op, "grad");
  check_same_device(args.rows, grad, op, "grad");
  TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == args.rows_count && grad.size(1) == args.outputs, "tutel::",
                    op, ": `grad` must have shape [N, O] = [", args.rows_count, ", ", args.outputs, "], got ",
                    grad.sizes());
  return grad.contiguous();
}

}  // namespace ops
}  // namespace tutel
