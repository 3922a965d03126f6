#include "decode_experts_args.h"

#include <cmath>
#include <limits>
#include <tuple>

#include "checks.h"

namespace tutel {
namespace ops {
namespace {

constexpr const char* kOp = "decode_experts";
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// An expert matrix: 3-D, in x's dtype, on x's device; contiguous, as the kernels index it.
at::Tensor expert_matrix(const at::Tensor& m, const at::Tensor& x, const char* name) {
  check_dim(m, 3, kOp, name);
  check_dtype(m, x.scalar_type(), kOp, name);
  check_same_device(x, m, kOp, name);
  return m.contiguous();
}

// expert_ids [T, k]: int32 or int64 only, the two the kernel reads without a conversion (which
// would be another launch per call on CUDA).

void check_unit(double alpha, double up_offset, c10::optional<double> limit) {
  TORCH_CHECK_VALUE(std::isfinite(alpha) && std::isfinite(up_offset), "tutel::", kOp,
                    ": alpha and up_offset must be finite, got alpha=", alpha, " and up_offset=", up_offset);
  TORCH_CHECK_VALUE(!limit.has_value() || (std::isfinite(*limit) && *limit > 0), "tutel::", kOp,
                    ": limit must be None or a finite number > 0, got ", limit.value_or(0.0));
}

}  // namespace

DecodeExpertsArgs decode_experts_args(const at::Tensor& x, const at::Tensor& expert_ids,
                                      const c10::optional<at::Tensor>& weights, const at::Tensor& up_weight,
                                      const at::Tensor& down_weight, const c10::optional<at::Tensor>& up_bias,
                                      const c10::optional<at::Tensor>& down_bias, bool transposed, double alpha,
                                      double up_offset, c10::optional<double> limit, bool interleaved,
                                      const c10::optional<at::Tensor>& gate_weight) {
  DecodeExpertsArgs a;
  check_dim(x, 2, kOp, "x");
  check_floating(x, kOp, "x");
  // The kernels step along a row one element (or 16 bytes) at a time; any row stride will do.
  a.x = x.size(1) <= 1 || x.stride(1) == 1 ? x : x.contiguous();
  check_routed_choices(x, expert_ids, weights, kOp);
  // (the kernels index the choices with 32-bit ints)
  TORCH_CHECK_VALUE(expert_ids.numel() <= kInt32Max, "tutel::", kOp,
                    ": at most 2^31-1 choices (tokens * k) are supported, got ", expert_ids.size(0),
                    " tokens and k=", expert_ids.size(1));
  a.expert_ids = expert_ids;
  if (weights.has_value()) a.weights = *weights;
  a.up_weight = expert_matrix(up_weight, x, "up_weight");
  a.down_weight = expert_matrix(down_weight, x, "down_weight");
  a.tokens = x.size(0);
  a.k = expert_ids.size(1);
  a.hidden = x.size(1);
  a.experts = up_weight.size(0);
  TORCH_CHECK_VALUE(a.experts >= 1 && a.experts <= kInt32Max && down_weight.size(0) == a.experts, "tutel::", kOp,
                    ": `up_weight` holds ", a.experts, " experts and `down_weight` ", down_weight.size(0),
                    "; both must hold the same number, between 1 and 2^31-1");
  // [E, U, H] and [E, O, I] (the F.linear layout), or [E, H, U] and [E, I, O] when transposed.
  const int64_t up_in = transposed ? up_weight.size(1) : up_weight.size(2);
  const int64_t up_out = transposed ? up_weight.size(2) : up_weight.size(1);
  a.inter = transposed ? down_weight.size(1) : down_weight.size(2);
  a.outputs = transposed ? down_weight.size(2) : down_weight.size(1);
  TORCH_CHECK_VALUE(up_in == a.hidden, "tutel::", kOp, ": `up_weight` ", up_weight.sizes(),
                    (transposed ? " ([E, H, U], transposed)" : " ([E, U, H])"), " must take the ", a.hidden,
                    " features of `x`");
  if (gate_weight.has_value()) {
    a.gate_weight = expert_matrix(*gate_weight, x, "gate_weight");
    TORCH_CHECK_VALUE(gate_weight->sizes() == up_weight.sizes(), "tutel::", kOp,
                      ": `gate_weight` must have the shape of `up_weight` ", up_weight.sizes(), ", got ",
                      gate_weight->sizes());
    TORCH_CHECK_VALUE(!interleaved && !up_bias.has_value(), "tutel::", kOp,
                      ": with a separate `gate_weight` the unit cannot be interleaved and there is no `up_bias`");
    TORCH_CHECK_VALUE(up_out == a.inter, "tutel::", kOp, ": with a separate `gate_weight` the up projection's ",
                      up_out, " outputs must equal the down projection's ", a.inter, " inputs");
  } else {
    TORCH_CHECK_VALUE(up_out == 2 * a.inter, "tutel::", kOp, ": the up projection's ", up_out,
                      " outputs must be twice the down projection's ", a.inter, " inputs (gate and up values)");
  }
  for (const auto& [name, bias, width, checked] :
       {std::make_tuple("up_bias", up_bias, up_out, &a.up_bias),
        std::make_tuple("down_bias", down_bias, a.outputs, &a.down_bias)}) {
    if (!bias.has_value()) continue;
    check_dtype(*bias, x.scalar_type(), kOp, name);
    TORCH_CHECK_VALUE(bias->dim() == 2 && bias->size(0) == a.experts && bias->size(1) == width, "tutel::", kOp,
                      ": `", name, "` must be [", a.experts, ", ", width, "], got ", bias->sizes());
    check_same_device(x, *bias, kOp, name);
    *checked = bias->contiguous();
  }
  check_unit(alpha, up_offset, limit);
  return a;
}

}  // namespace ops
}  // namespace tutel
