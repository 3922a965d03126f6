#include "expert_rows_args.h"

#include <cstdint>
#include <limits>

#include "checks.h"
#include "core_types.h"

namespace tutel {
namespace ops {
namespace {

void check_rows(const at::Tensor& rows, const char* op, const char* name) {
  check_dim(rows, 2, op, name);
  check_floating(rows, op, name);
}

}  // namespace

ExpertBias checked_add_expert_bias(const at::Tensor& rows, const at::Tensor& bias, const at::Tensor& offsets_in) {
  const char* op = "add_expert_bias_";
  check_rows(rows, op, "rows");
  const int64_t n = rows.size(0), columns = rows.size(1);
  // Written in place, so no copy can stand in for a layout the kernels cannot walk.
  TORCH_CHECK_VALUE((columns <= 1 || rows.stride(1) == 1) && (n <= 1 || rows.stride(0) >= columns), "tutel::", op,
                    ": `rows` must have contiguous elements within each row and rows that do not overlap (strides "
                    "[s, 1] with s >= ", columns, "), got strides ", rows.strides());
  const at::Tensor offsets = checked_offsets(offsets_in, rows, op);
  check_dtype(bias, rows.scalar_type(), op, "bias");
  check_same_device(rows, bias, op, "bias");
  TORCH_CHECK_VALUE(bias.dim() == 2 && bias.size(0) == offsets.size(0) && bias.size(1) == columns, "tutel::", op,
                    ": `bias` must have shape [E, C] = [", offsets.size(0), ", ", columns,
                    "] (an expert per entry of `offsets`, the columns of `rows`), got ", bias.sizes());
  return ExpertBias{rows_with_unit_stride(bias), offsets};
}

GroupedRows checked_expert_row_sums(const at::Tensor& rows, const at::Tensor& offsets) {
  const char* op = "expert_row_sums";
  check_rows(rows, op, "rows");
  return GroupedRows{rows_with_unit_stride(rows), checked_offsets(offsets, rows, op)};
}

ChoiceRows checked_choice_rows(const at::Tensor& x, const at::Tensor& slot_choices, int64_t k) {
  const char* op = "choice_rows";
  check_rows(x, op, "x");
  check_dim(slot_choices, 1, op, "slot_choices");
  check_dtype(slot_choices, at::kLong, op, "slot_choices");
  check_same_device(x, slot_choices, op, "slot_choices");
  TORCH_CHECK_VALUE(k >= 1, "tutel::", op, ": `k` must be >= 1, got ", k);
  TORCH_CHECK_VALUE(x.size(0) <= std::numeric_limits<int64_t>::max() / k, "tutel::", op, ": T k = ", x.size(0),
                    " * ", k, " choices do not fit in int64");
  return ChoiceRows{rows_with_unit_stride(x), slot_choices.contiguous()};
}

}  // namespace ops
}  // namespace tutel
