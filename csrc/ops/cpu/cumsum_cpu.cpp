// CPU implementation of cumsum_sub_one.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../../core/cumsum.h"
#include "../op_args.h"

namespace tutel {
namespace ops {
namespace {

template <class In, class Out>
void run(const at::Tensor& mask, at::Tensor& out) {
  core::cumsum_sub_one(mask.data_ptr<In>(), mask.size(0), mask.size(1), out.data_ptr<Out>());
}

at::Tensor cumsum_sub_one_cpu(const at::Tensor& mask_in) {
  const char* op = "cumsum_sub_one";
  check_dim(mask_in, 2, op, "mask");
  const at::Tensor mask = mask_in.contiguous();
  const auto dtype = mask.scalar_type();
  at::Tensor out = at::empty(mask.sizes(), mask.options().dtype(cumsum_output_dtype(dtype)));
  switch (dtype) {
    case at::kBool: run<bool, int64_t>(mask, out); break;
    case at::kByte: run<uint8_t, int64_t>(mask, out); break;
    case at::kChar: run<int8_t, int64_t>(mask, out); break;
    case at::kShort: run<int16_t, int64_t>(mask, out); break;
    case at::kInt: run<int32_t, int64_t>(mask, out); break;
    case at::kLong: run<int64_t, int64_t>(mask, out); break;
    case at::kFloat: run<float, float>(mask, out); break;
    default: run<double, double>(mask, out); break;  // cumsum_output_dtype allowed nothing else
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) { m.impl("cumsum_sub_one", &cumsum_sub_one_cpu); }

}  // namespace ops
}  // namespace tutel
