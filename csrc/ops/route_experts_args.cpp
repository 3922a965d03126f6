#include "route_experts_args.h"

#include <cmath>
#include <limits>

#include "../../kernels/kernel_abi.h"
#include "checks.h"
#include "core_types.h"

namespace tutel {
namespace ops {
namespace {

constexpr const char* kForward = "route_experts";
constexpr const char* kBackward = "route_experts_backward";
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

core::ScoreFunction score_function_of(const std::string& name, const char* op) {
  if (name == "softmax") return core::ScoreFunction::kSoftmax;
  if (name == "sigmoid") return core::ScoreFunction::kSigmoid;
  TORCH_CHECK_VALUE(name == "sqrt_softplus", "tutel::", op, ": score_function='", name,
                    "' is not allowed; use 'softmax', 'sigmoid' or 'sqrt_softplus'");
  return core::ScoreFunction::kSqrtSoftplus;
}

// logits [T, E] floating, T k choices numbered by int32.
void check_logits(const at::Tensor& logits, int64_t k, const char* op) {
  check_dim(logits, 2, op, "logits");
  check_floating(logits, op, "logits");
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK_VALUE(experts >= 1 && experts <= kInt32Max, "tutel::", op,
                    ": `logits` must have between 1 and 2^31-1 expert columns, got ", experts);
  TORCH_CHECK_VALUE(k >= 1 && k <= experts, "tutel::", op, ": k=", k,
                    " is not allowed; k must satisfy 1 <= k <= num_experts=", experts);
  TORCH_CHECK_VALUE(tokens * k <= kInt32Max, "tutel::", op, ": at most 2^31-1 choices (tokens * k) are supported, got ",
                    tokens, " tokens and k=", k);
}

void check_scores(core::ScoreFunction score, bool softmax_after_topk, double scaling, const char* op) {
  TORCH_CHECK_VALUE(!softmax_after_topk || score == core::ScoreFunction::kSoftmax, "tutel::", op,
                    ": softmax_after_topk=True takes a softmax over the chosen logits; it needs "
                    "score_function='softmax'");
  TORCH_CHECK_VALUE(std::isfinite(scaling), "tutel::", op, ": routed_scaling_factor must be a finite number, got ",
                    scaling);
}

}  // namespace

RouteExpertsArgs route_experts_args(const at::Tensor& logits, int64_t k, const std::string& score_function,
                                    bool softmax_after_topk, const c10::optional<at::Tensor>& selection_bias,
                                    int64_t n_group, int64_t topk_group, bool renormalize,
                                    double routed_scaling_factor, bool batch_prioritized, int64_t capacity,
                                    bool with_loss) {
  const char* op = kForward;
  check_logits(logits, k, op);
  RouteExpertsArgs args;
  args.logits = logits.contiguous();
  args.tokens = logits.size(0);
  args.experts = logits.size(1);
  core::RouteExpertsOptions& o = args.options;
  o.k = k;
  o.score = score_function_of(score_function, op);
  o.softmax_after_topk = softmax_after_topk;
  check_scores(o.score, softmax_after_topk, routed_scaling_factor, op);
  if (selection_bias.has_value()) {
    const at::Tensor& bias = *selection_bias;
    TORCH_CHECK_TYPE(bias.scalar_type() == at::kFloat || bias.scalar_type() == at::kDouble, "tutel::", op,
                     ": `selection_bias` must be float32 or float64, got ", bias.scalar_type());
    TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == args.experts, "tutel::", op,
                      ": `selection_bias` must have shape [num_experts] = [", args.experts, "], got ", bias.sizes());
    check_same_device(logits, bias, op, "selection_bias");
    args.selection_bias = bias.contiguous();
  }
  if (n_group == 0) {
    TORCH_CHECK_VALUE(topk_group == 0, "tutel::", op, ": topk_group=", topk_group,
                      " needs n_group; without a group limit both are 0");
  } else {
    TORCH_CHECK_VALUE(n_group >= 1 && n_group <= TUTEL_ROUTE_MAX_GROUPS && args.experts % n_group == 0, "tutel::", op,
                      ": n_group=", n_group, " is not allowed; it must divide the ", args.experts,
                      " experts into equal groups and be at most ", TUTEL_ROUTE_MAX_GROUPS, " (0: no group limit)");
    TORCH_CHECK_VALUE(topk_group >= 1 && topk_group <= n_group, "tutel::", op, ": topk_group=", topk_group,
                      " is not allowed; it must satisfy 1 <= topk_group <= n_group=", n_group);
    const int64_t allowed = topk_group * (args.experts / n_group);
    TORCH_CHECK_VALUE(k <= allowed, "tutel::", op, ": k=", k, " exceeds the ", allowed,
                      " experts of the topk_group=", topk_group, " groups a token may use; allowed: 1 <= k <= ",
                      allowed);
  }
  o.n_group = n_group;
  o.topk_group = topk_group;
  o.renormalize = renormalize;
  o.routed_scaling_factor = routed_scaling_factor;
  o.batch_prioritized = batch_prioritized;
  TORCH_CHECK_VALUE(capacity >= -1, "tutel::", op, ": capacity=", capacity,
                    " is not allowed; it must be >= 0 slots per expert, or -1 for dropless routing");
  TORCH_CHECK_VALUE(capacity < 0 || args.experts * capacity <= kInt32Max, "tutel::", op, ": capacity=", capacity,
                    " gives ", args.experts, " * ", capacity, " rows, more than 2^31-1");
  o.capacity = capacity;
  o.with_loss = with_loss;
  return args;
}

RouteExpertsOutputs allocate_route_experts_outputs(const RouteExpertsArgs& args) {
  const int64_t k = args.options.k, tokens = args.tokens, experts = args.experts;
  const auto options = args.logits.options();
  const auto ints = options.dtype(at::kInt);
  const auto acc = options.dtype(accumulation_dtype(args.logits.scalar_type()));
  RouteExpertsOutputs out;
  out.expert_ids = at::empty({k, tokens}, ints);
  out.weights = at::empty({k, tokens}, acc);
  out.locations = at::empty({k, tokens}, ints);
  out.counts = at::empty({k, experts}, ints);
  out.dispatch_count = at::empty({experts}, options.dtype(at::kLong));
  out.grouped_locations = at::empty({k, tokens}, ints);
  out.ends = at::empty({experts}, ints);
  out.row_choices = at::empty({core::route_experts_rows(tokens, experts, k, args.options.capacity)}, ints);
  out.loss = at::empty({}, acc);
  return out;
}

RouteExpertsBackwardArgs route_experts_backward_args(const c10::optional<at::Tensor>& grad_weights,
                                                     const c10::optional<at::Tensor>& grad_loss,
                                                     const at::Tensor& logits, const at::Tensor& expert_ids,
                                                     const at::Tensor& counts, const std::string& score_function,
                                                     bool softmax_after_topk, bool renormalize,
                                                     double routed_scaling_factor, bool with_loss) {
  const char* op = kBackward;
  check_dim(expert_ids, 2, op, "expert_ids");
  check_dtype(expert_ids, at::kInt, op, "expert_ids");
  const int64_t k = expert_ids.size(0);
  check_logits(logits, k, op);
  RouteExpertsBackwardArgs args;
  args.logits = logits.contiguous();
  args.tokens = logits.size(0);
  args.experts = logits.size(1);
  TORCH_CHECK_VALUE(expert_ids.size(1) == args.tokens, "tutel::", op, ": `expert_ids` must be [k, ", args.tokens,
                    "], got ", expert_ids.sizes());
  check_same_device(logits, expert_ids, op, "expert_ids");
  args.expert_ids = expert_ids.contiguous();
  check_dtype(counts, at::kInt, op, "counts");
  TORCH_CHECK_VALUE(counts.dim() == 2 && counts.size(0) == k && counts.size(1) == args.experts, "tutel::", op,
                    ": `counts` must be [k, num_experts] = [", k, ", ", args.experts, "], got ", counts.sizes());
  check_same_device(logits, counts, op, "counts");
  args.counts = counts.contiguous();
  const at::ScalarType acc = accumulation_dtype(logits.scalar_type());
  if (grad_weights.has_value()) {
    check_dtype(*grad_weights, acc, op, "grad_weights");
    TORCH_CHECK_VALUE(grad_weights->sizes() == expert_ids.sizes(), "tutel::", op,
                      ": `grad_weights` must have the shape of `expert_ids` ", expert_ids.sizes(), ", got ",
                      grad_weights->sizes());
    check_same_device(logits, *grad_weights, op, "grad_weights");
    args.grad_weights = grad_weights->contiguous();
  }
  if (grad_loss.has_value()) {
    check_dtype(*grad_loss, acc, op, "grad_loss");
    TORCH_CHECK_VALUE(grad_loss->numel() == 1, "tutel::", op, ": `grad_loss` must hold one value, got shape ",
                      grad_loss->sizes());
    check_same_device(logits, *grad_loss, op, "grad_loss");
    args.grad_loss = grad_loss->contiguous();
  }
  core::RouteExpertsOptions& o = args.options;
  o.k = k;
  o.score = score_function_of(score_function, op);
  o.softmax_after_topk = softmax_after_topk;
  check_scores(o.score, softmax_after_topk, routed_scaling_factor, op);
  o.renormalize = renormalize;
  o.routed_scaling_factor = routed_scaling_factor;
  o.with_loss = with_loss;
  return args;
}

}  // namespace ops
}  // namespace tutel
