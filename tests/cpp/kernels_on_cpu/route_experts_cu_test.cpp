// kernels/route_experts.cu on the CPU, launched as csrc/ops/cuda/route_experts_cuda.cpp launches it
// (route_experts_route, then route_experts_plan; route_experts_backward), against csrc/core's
// route_experts_forward / route_experts_backward: every output bit for bit, for every score
// function, softmax_after_topk, bias, group limit, renormalisation, scaling, batch priority,
// capacity and the loss, with ties, NaN, +-0 and +-inf among the logits.  The forward also runs under
// the cross-block schedules (route_experts_plan's blocks pass phases through counters and fences)
// with its buffers as weak memory.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/route_experts.h"
#include "core/scalar.h"
#include "harness.h"
// The kernel file under test: a mutant build (mutants.cmake) names a copy with one bug in it.
#ifndef TUTEL_KERNEL_SOURCE
#define TUTEL_KERNEL_SOURCE "../../../kernels/route_experts.cu"
#endif
#include TUTEL_KERNEL_SOURCE
#include "variant_types.h"

namespace {

using namespace kernels_on_cpu;
namespace core = tutel::core;
using core::ScoreFunction;

enum class Bias { kNone, kFloat32, kFloat64 };

struct Case {
  int64_t tokens, experts, k;
  ScoreFunction score = ScoreFunction::kSoftmax;
  bool after_topk = false;
  Bias bias = Bias::kNone;
  int64_t n_group = 0, topk_group = 0;
  bool renormalize = false;
  double scale = 1.0;
  bool prioritized = false;
  int64_t capacity = -1;
  bool loss = true;
  bool specials = false;  // NaN, +-0, +-inf among the logits
  int64_t chunk_tokens = 0;  // 0: the operator's plan; else a plan with this chunk (scan over many chunks)
  bool large = false;        // one schedule and one backward only (the emulation is slow)

  core::RouteExpertsOptions options() const {
    core::RouteExpertsOptions o;
    o.k = k;
    o.score = score;
    o.softmax_after_topk = after_topk;
    o.n_group = n_group;
    o.topk_group = topk_group;
    o.renormalize = renormalize;
    o.routed_scaling_factor = scale;
    o.batch_prioritized = prioritized;
    o.capacity = capacity;
    o.with_loss = loss;
    return o;
  }
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "T=" << c.tokens << " E=" << c.experts << " k=" << c.k << " score=" << int(c.score)
       << " after=" << c.after_topk << " bias=" << int(c.bias) << " groups=" << c.n_group << "/" << c.topk_group
       << " renorm=" << c.renormalize << " scale=" << c.scale << " prio=" << c.prioritized
       << " capacity=" << c.capacity << " loss=" << c.loss << " specials=" << c.specials;
}

struct Inputs {
  std::vector<storage_t> logits;
  std::vector<float> bias32;
  std::vector<double> bias64;
  std::vector<acc_t> grad_weights;
  acc_t grad_loss;
};

Inputs random_inputs(const Case& c, unsigned seed) {
  std::mt19937 rng(seed);
  Inputs in;
  // Many ties (multiples of 1/4 in [-3, 3]) and, with `specials`, NaN, +-0 and +-inf.
  in.logits = tied_values(static_cast<size_t>(c.tokens * c.experts), 12, c.specials ? 60 : 0, rng);
  std::uniform_real_distribution<double> small(-0.5, 0.5);
  if (c.bias == Bias::kFloat32)
    for (int64_t e = 0; e < c.experts; ++e) in.bias32.push_back(float(small(rng)));
  if (c.bias == Bias::kFloat64)
    for (int64_t e = 0; e < c.experts; ++e) in.bias64.push_back(small(rng));
  for (int64_t i = 0; i < c.k * c.tokens; ++i) in.grad_weights.push_back(acc_t(small(rng)));
  in.grad_loss = acc_t(0.75);
  return in;
}

core::SelectionBias core_bias(const Inputs& in) {
  return core::SelectionBias{in.bias32.empty() ? nullptr : in.bias32.data(),
                             in.bias64.empty() ? nullptr : in.bias64.data()};
}

bool is_nan(acc_t v) { return v != v; }
#if defined(TUTEL_DTYPE_FLOAT16) || defined(TUTEL_DTYPE_BFLOAT16)
bool is_nan(storage_t v) { return is_nan(to_acc(v)); }
#endif

struct Routing {
  std::vector<int32_t> expert_ids, locations, counts, grouped_locations, ends, row_choices;
  std::vector<acc_t> weights, loss;
  std::vector<int64_t> dispatch_count;

  explicit Routing(const Case& c)
      : expert_ids(garbage<int32_t>(c.k * c.tokens)), locations(garbage<int32_t>(c.k * c.tokens)),
        counts(garbage<int32_t>(c.k * c.experts)), grouped_locations(garbage<int32_t>(c.k * c.tokens)),
        ends(garbage<int32_t>(c.experts)),
        row_choices(garbage<int32_t>(core::route_experts_rows(c.tokens, c.experts, c.k, c.capacity))),
        weights(garbage<acc_t>(c.k * c.tokens)), loss(garbage<acc_t>(1)),
        dispatch_count(garbage<int64_t>(c.experts)) {}

  void zero() {
    for (auto* v : {&expert_ids, &locations, &counts, &grouped_locations, &ends, &row_choices})
      std::fill(v->begin(), v->end(), 0);
    std::fill(weights.begin(), weights.end(), acc_t(0));
    loss[0] = acc_t(0);
    std::fill(dispatch_count.begin(), dispatch_count.end(), 0);
  }
};

tutel::cuda::RouteExpertsPlan plan_for(const Case& c, bool prioritized, bool loss) {
  tutel::cuda::RouteExpertsPlan plan =
      tutel::cuda::plan_route_experts(c.tokens, c.experts, c.k, c.capacity, prioritized, loss);
  if (c.chunk_tokens == 0) return plan;
  // The same plan with smaller chunks: chunks beyond one scan tile.
  plan.chunk_tokens = c.chunk_tokens;
  plan.chunks = std::max<int64_t>(1, (c.tokens + c.chunk_tokens - 1) / c.chunk_tokens);
  plan.table_ints = plan.chunks * c.k * c.experts;
  plan.int_workspace_ints = TUTEL_ROUTE_SYNC_INTS + plan.table_ints + (prioritized ? 2 * c.tokens : 0);
  plan.acc_workspace = loss ? (plan.chunks + 1) * c.experts : 0;
  plan.count_blocks = prioritized ? plan.chunks : 0;
  plan.assign_blocks = (plan.chunks + 7) / 8;
  plan.route_grid = tutel::cuda::Grid{plan.chunks, 1};
  plan.plan_grid = tutel::cuda::Grid{plan.rank_blocks + plan.count_blocks + c.experts + plan.assign_blocks, 1};
  return plan;
}

// The CUDA operator's forward with the emulated kernels.  With `weak`, every buffer the kernels write
// is weak memory (cuda_emulation.h) and starts as zeros instead of garbage: a block that reads
// another's unpublished store then sees zeros, which keep every index the plan derives from it in
// range, so a missing fence shows as a wrong result rather than as a write outside the buffers.
Routing route_on_cpu(const Case& c, const Inputs& in, LaunchOptions options, bool weak = false) {
  const bool prioritized = c.prioritized && c.tokens > 0, loss = c.loss && c.tokens > 0;
  const auto plan = plan_for(c, prioritized, loss);
  Routing r(c);
  std::vector<int> workspace = garbage<int>(plan.int_workspace_ints);
  std::vector<acc_t> acc_workspace = garbage<acc_t>(plan.acc_workspace);
  std::vector<sort_key_t> keys = garbage<sort_key_t>(plan.key_workspace);
  if (weak) {
    r.zero();
    std::fill(workspace.begin(), workspace.end(), 0);
    std::fill(acc_workspace.begin(), acc_workspace.end(), acc_t(0));
    std::fill(keys.begin(), keys.end(), sort_key_t(0));
    options.weak_memory = {region_of(workspace), region_of(acc_workspace), region_of(keys), region_of(r.expert_ids),
                           region_of(r.locations), region_of(r.counts), region_of(r.grouped_locations),
                           region_of(r.ends), region_of(r.row_choices), region_of(r.weights), region_of(r.loss),
                           region_of(r.dispatch_count)};
  }
  int* sync = workspace.data();
  int* table = sync + TUTEL_ROUTE_SYNC_INTS;
  int* run_tokens = prioritized ? table + plan.table_ints : nullptr;
  int* order = prioritized ? run_tokens + c.tokens : nullptr;
  acc_t* chunk_sums = loss ? acc_workspace.data() : nullptr;
  acc_t* column_sums = loss ? chunk_sums + plan.chunks * c.experts : nullptr;
  const float* bias32 = in.bias32.empty() ? nullptr : in.bias32.data();
  const double* bias64 = in.bias64.empty() ? nullptr : in.bias64.data();
  auto data = [](auto& v) { return v.empty() ? nullptr : v.data(); };
  TUTEL_EMULATED_LAUNCH(route_experts_route, plan.route_grid, options, data(in.logits), c.tokens, c.experts, c.k,
                        int(c.score), int(c.after_topk), bias32, bias64, c.n_group, c.topk_group,
                        int(c.renormalize), c.scale, int(loss), int(prioritized), plan.chunk_tokens,
                        data(r.expert_ids), data(r.weights), table, chunk_sums, data(keys), run_tokens, sync);
  TUTEL_EMULATED_LAUNCH(route_experts_plan, plan.plan_grid, options, c.tokens, c.experts, c.k, c.capacity,
                        plan.chunk_tokens, plan.chunks, plan.rows, int(loss), int(prioritized), plan.rank_blocks,
                        plan.count_blocks, plan.assign_blocks, data(r.expert_ids), table, chunk_sums, data(keys),
                        run_tokens, order, column_sums, sync, data(r.counts),
                        reinterpret_cast<i64*>(data(r.dispatch_count)), data(r.ends), r.loss.data(),
                        data(r.locations), data(r.grouped_locations), data(r.row_choices));
  return r;
}

Routing route_in_core(const Case& c, const Inputs& in) {
  Routing r(c);
  core::RouteExpertsResult<acc_t> out{r.expert_ids.data(), r.weights.data(), r.locations.data(),
                                      r.counts.data(), r.dispatch_count.data(), r.grouped_locations.data(),
                                      r.ends.data(), r.row_choices.data(), r.loss.data()};
  core::route_experts_forward(reinterpret_cast<const CoreT*>(in.logits.data()), c.tokens, c.experts, c.options(),
                              core_bias(in), out);
  return r;
}

std::vector<storage_t> backward_on_cpu(const Case& c, const Inputs& in, const Routing& forward, bool weights_grad,
                                       bool loss_grad, const LaunchOptions& options) {
  std::vector<storage_t> grad = garbage<storage_t>(c.tokens * c.experts);
  const bool loss = c.loss && loss_grad && c.tokens > 0;
  TUTEL_EMULATED_LAUNCH(route_experts_backward, tutel::cuda::plan_route_experts_backward(c.tokens), options,
                        weights_grad ? in.grad_weights.data() : nullptr, loss_grad ? &in.grad_loss : nullptr,
                        in.logits.data(), c.tokens, c.experts, c.k, forward.expert_ids.data(), forward.counts.data(),
                        int(c.score), int(c.after_topk), int(c.renormalize), c.scale, int(loss),
                        grad.empty() ? nullptr : grad.data());
  return grad;
}

std::vector<storage_t> backward_in_core(const Case& c, const Inputs& in, const Routing& forward, bool weights_grad,
                                        bool loss_grad) {
  std::vector<storage_t> grad = garbage<storage_t>(c.tokens * c.experts);
  core::route_experts_backward(weights_grad ? in.grad_weights.data() : nullptr, loss_grad ? &in.grad_loss : nullptr,
                               reinterpret_cast<const CoreT*>(in.logits.data()), c.tokens, c.experts,
                               forward.expert_ids.data(), forward.counts.data(), c.options(),
                               reinterpret_cast<CoreT*>(grad.data()));
  return grad;
}

// Bit for bit, except that NaN equals NaN whatever its sign and payload: an x86 NaN takes the sign
// of whichever NaN operand the compiler put first, and a GPU's NaN is canonical anyway.
template <class T>
::testing::AssertionResult same_values(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return same_bits(got, want);
  std::vector<T> got_canonical = got, want_canonical = want;
  for (size_t i = 0; i < got.size(); ++i) {
    if (is_nan(got[i]) && is_nan(want[i])) got_canonical[i] = want_canonical[i];
  }
  return same_bits(got_canonical, want_canonical);
}

void expect_same_routing(const Routing& got, const Routing& want) {
  EXPECT_TRUE(same_bits(got.expert_ids, want.expert_ids)) << "expert_ids";
  EXPECT_TRUE(same_values(got.weights, want.weights)) << "weights";
  EXPECT_TRUE(same_bits(got.locations, want.locations)) << "locations";
  EXPECT_TRUE(same_bits(got.counts, want.counts)) << "counts";
  EXPECT_TRUE(same_bits(got.dispatch_count, want.dispatch_count)) << "dispatch_count";
  EXPECT_TRUE(same_bits(got.grouped_locations, want.grouped_locations)) << "grouped_locations";
  EXPECT_TRUE(same_bits(got.ends, want.ends)) << "ends";
  EXPECT_TRUE(same_bits(got.row_choices, want.row_choices)) << "row_choices";
  EXPECT_TRUE(same_values(got.loss, want.loss)) << "loss";
}

class RouteExpertsCu : public ::testing::TestWithParam<Case> {};

TEST_P(RouteExpertsCu, ForwardAndBackwardMatchCoreBitForBit) {
  const Case& c = GetParam();
  const unsigned seed = unsigned(c.tokens * 7 + c.experts * 131 + c.k * 17 + int(c.score) * 3 + c.n_group);
  const Inputs in = random_inputs(c, seed);
  const Routing want = route_in_core(c, in);
  std::vector<LaunchOptions> schedules = schedules_for_case(int(seed % 97));
  if (c.large) schedules.resize(1);
  for (const LaunchOptions& options : schedules) {
    SCOPED_TRACE(::testing::Message() << "schedule " << int(options.schedule));
    const Routing got = route_on_cpu(c, in, options);
    expect_same_routing(got, want);
    for (const bool weights_grad : {true, false}) {
      for (const bool loss_grad : {true, false}) {
        if (c.large && !(weights_grad && loss_grad)) continue;
        SCOPED_TRACE(::testing::Message() << "grad weights " << weights_grad << ", grad loss " << loss_grad);
        EXPECT_TRUE(same_values(backward_on_cpu(c, in, want, weights_grad, loss_grad, options),
                              backward_in_core(c, in, want, weights_grad, loss_grad)))
            << "grad_logits";
      }
    }
  }
  if (c.large) return;
  // The plan kernel's phases (tickets, counters, fences) with blocks interleaved or delayed and
  // stores unpublished until fenced.
  std::vector<LaunchOptions> cross_block = cross_block_schedules_for_case(int(seed % 89));
  if (c.chunk_tokens != 0) cross_block.resize(1);  // over a thousand blocks: one is enough
  for (const LaunchOptions& options : cross_block) {
    SCOPED_TRACE(::testing::Message() << "grid schedule " << int(options.grid) << ", resident "
                                      << options.resident_blocks << ", schedule " << int(options.schedule)
                                      << ", weak memory");
    expect_same_routing(route_on_cpu(c, in, options, true), want);
  }
}

Case with(Case c, void (*change)(Case&)) {
  change(c);
  return c;
}

// Every option alone and in the combinations the models use; empty and tiny inputs, odd sizes,
// several chunks and assign blocks, more experts than a warp has lanes and than the offsets cache
// holds, groups of one expert and more groups than lanes, capacities that drop, no capacity at all.
std::vector<Case> cases() {
  std::vector<Case> all;
  all.push_back(Case{0, 4, 1});
  all.push_back(with(Case{0, 5, 2}, [](Case& c) { c.capacity = 3; c.prioritized = true; }));
  all.push_back(Case{1, 1, 1});
  all.push_back(with(Case{37, 5, 2}, [](Case& c) { c.renormalize = true; c.specials = true; }));
  all.push_back(with(Case{37, 5, 2}, [](Case& c) { c.specials = true; c.prioritized = true; c.capacity = 6; }));
  all.push_back(with(Case{130, 64, 8}, [](Case& c) { c.renormalize = true; c.capacity = 9; }));
  all.push_back(with(Case{130, 64, 8}, [](Case& c) { c.score = ScoreFunction::kSigmoid; c.bias = Bias::kFloat32;
                                                      c.n_group = 8; c.topk_group = 4; c.renormalize = true;
                                                      c.scale = 2.5; }));
  all.push_back(with(Case{67, 256, 8}, [](Case& c) { c.score = ScoreFunction::kSigmoid; c.bias = Bias::kFloat32;
                                                     c.n_group = 8; c.topk_group = 4; c.renormalize = true;
                                                     c.scale = 2.5; c.prioritized = true; c.capacity = 3; }));
  all.push_back(with(Case{45, 300, 3}, [](Case& c) { c.score = ScoreFunction::kSqrtSoftplus; c.bias = Bias::kFloat64;
                                                     c.renormalize = true; c.scale = 1.5; c.specials = true; }));
  all.push_back(with(Case{45, 96, 5}, [](Case& c) { c.score = ScoreFunction::kSqrtSoftplus; c.n_group = 48;
                                                    c.topk_group = 5; c.capacity = 0; }));
  all.push_back(with(Case{29, 12, 4}, [](Case& c) { c.n_group = 12; c.topk_group = 7; c.bias = Bias::kFloat64;
                                                    c.specials = true; }));
  all.push_back(with(Case{90, 32, 4}, [](Case& c) { c.after_topk = true; c.specials = true; c.capacity = 5; }));
  all.push_back(with(Case{90, 32, 4}, [](Case& c) { c.after_topk = true; c.loss = false; c.bias = Bias::kFloat32;
                                                    c.renormalize = true; c.prioritized = true; }));
  all.push_back(with(Case{530, 3, 3}, [](Case& c) { c.renormalize = true; c.prioritized = true; c.capacity = 200; }));
  all.push_back(with(Case{200, 7, 1}, [](Case& c) { c.score = ScoreFunction::kSigmoid; c.loss = false; }));
  // k above 32 (the CPU's partial sort), and with 40 groups of which 35 are kept.
  all.push_back(with(Case{20, 80, 40}, [](Case& c) { c.renormalize = true; c.specials = true; c.capacity = 7; }));
  all.push_back(with(Case{20, 80, 40}, [](Case& c) { c.n_group = 40; c.topk_group = 35; c.prioritized = true; }));
  // Chunks of 16 tokens (two per warp).
  all.push_back(with(Case{8200, 2, 1}, [](Case& c) { c.renormalize = true; c.capacity = 3000; c.large = true; }));
  // 1100 chunks of one token: the scan takes two tiles (the loss's order follows the chunks: not compared).
  all.push_back(with(Case{1100, 6, 2}, [](Case& c) { c.chunk_tokens = 1; c.prioritized = true; c.capacity = 250;
                                                     c.loss = false; }));
  return all;
}

INSTANTIATE_TEST_SUITE_P(Options, RouteExpertsCu, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  return "T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_k" + std::to_string(c.k) + "_" +
         std::to_string(info.index);
});

}  // namespace
