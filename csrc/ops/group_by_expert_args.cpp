#include "group_by_expert_args.h"

#include <cstdint>

namespace tutel {
namespace ops {

at::Tensor checked_group_by_expert_ids(const at::Tensor& expert_ids, int64_t experts) {
  const char* op = "group_by_expert";
  TORCH_CHECK_VALUE(expert_ids.dim() == 2, "tutel::", op, ": `expert_ids` must be [T, k], got ", expert_ids.dim(),
                    " dims");
  TORCH_CHECK_TYPE(at::isIntegralType(expert_ids.scalar_type(), /*includeBool=*/false), "tutel::", op,
                   ": `expert_ids` must hold integers, got ", expert_ids.scalar_type());
  TORCH_CHECK_VALUE(experts >= 1, "tutel::", op, ": `num_experts` must be >= 1, got ", experts);
  const int64_t tokens = expert_ids.size(0), k = expert_ids.size(1);
  TORCH_CHECK_VALUE(tokens * k < (int64_t(1) << 31) && experts < (int64_t(1) << 31), "tutel::", op,
                    ": at most 2^31 - 1 choices and experts (int32 locations), got ", tokens * k, " choices and ",
                    experts, " experts");
  const at::ScalarType dtype = expert_ids.scalar_type();
  return dtype == at::kInt || dtype == at::kLong ? expert_ids : expert_ids.to(at::kLong);
}

}  // namespace ops
}  // namespace tutel
