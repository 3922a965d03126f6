// select_rows: rows of a matrix picked by index into a reused buffer.  It is
// torch.index_select(x, 0, index) except for where the result lives: the grouped
// inference path gathers tens of MB of token rows per piece, and a fresh tensor of
// that size costs more in page faults than the copy (docs/performance.md, "Routed
// experts on the CPU").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../checks.h"
#include "reusable_buffers.h"

namespace tutel {
namespace ops {
namespace {

at::Tensor select_rows_cpu(const at::Tensor& x, const at::Tensor& index) {
  const char* op = "select_rows";
  check_dim(x, 2, op, "x");
  check_dim(index, 1, op, "index");
  TORCH_CHECK_VALUE(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt, "tutel::", op,
                    ": `index` must be int64 or int32, got ", index.scalar_type());
  at::Tensor out = empty_reusable({index.size(0), x.size(1)}, x.options());
  return at::index_select_out(out, x, 0, index);
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) { m.impl("select_rows", &select_rows_cpu); }

}  // namespace ops
}  // namespace tutel
