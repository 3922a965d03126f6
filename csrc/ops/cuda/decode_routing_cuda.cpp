#include "decode_routing_cuda.h"

#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

int weights_dtype_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return TUTEL_WEIGHTS_FLOAT64;
    case at::kHalf: return TUTEL_WEIGHTS_FLOAT16;
    case at::kBFloat16: return TUTEL_WEIGHTS_BFLOAT16;
    default: return TUTEL_WEIGHTS_FLOAT32;  // float32, the one floating dtype left (checked)
  }
}

}  // namespace

TutelDecodeRouting decode_routing(const at::Tensor& expert_ids, const at::Tensor& weights, int64_t tokens, int64_t k,
                                  int64_t experts) {
  TutelDecodeRouting r{};
  r.expert_ids = input_ptr(expert_ids);
  r.ids_token_stride = expert_ids.stride(0);
  r.ids_choice_stride = expert_ids.stride(1);
  r.ids_int64 = expert_ids.scalar_type() == at::kLong;
  if (weights.defined()) {  // else weights stays null: weight 1
    r.weights = input_ptr(weights);
    r.weights_token_stride = weights.stride(0);
    r.weights_choice_stride = weights.stride(1);
    r.weights_dtype = weights_dtype_of(weights.scalar_type());
  }
  r.tokens = tokens;
  r.k = k;
  r.experts = experts;
  return r;
}

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
