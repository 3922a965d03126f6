// to_dtype: a contiguous copy of a tensor in another dtype, in a reused buffer.  It is
// x.to(dtype) except for where the result lives: 16-bit expert weights widened to float32 for
// the GEMMs (tutel.ops.precision) are hundreds of MB per call, and a fresh tensor of that size
// costs more in page faults than the conversion (docs/performance.md, "Reused CPU buffers").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "reusable_buffers.h"

namespace tutel {
namespace ops {

TORCH_LIBRARY_IMPL(tutel, CPU, m) { m.impl("to_dtype", &to_dtype_reusable); }

}  // namespace ops
}  // namespace tutel
