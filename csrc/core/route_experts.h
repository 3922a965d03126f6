// Fused expert routing (tutel::route_experts): from the gate's logits to the chosen experts, their
// weights, GShard slots, the grouped-rows plan and the GShard loss, with its backward.
//
// The arithmetic is fixed to the last rounding so that the CUDA kernels of kernels/route_experts.cu
// give the same bits (on the CPU emulation; a GPU's exp / log1p may differ by an ulp):
//   * sums over a token's experts are taken in "warp order": 32 partial sums, expert e into partial
//     e % 32 in increasing e, then combined pairwise at distances 16, 8, 4, 2, 1 (partial p gets
//     p + (p ^ d)); the result is partial 0;
//   * sums over chunks and over experts are taken in "block order": 256 partials, item i into
//     partial i % 256, each group of 32 partials combined in warp order, then the 8 group results
//     added in order;
//   * sums over a token's k choices and over the tokens of one chunk are sequential.
// Layouts: logits [T, E] row-major; [k, T] tensors choice-major (entry j * T + t).
#pragma once

#include <cstdint>

#include "scalar.h"

namespace tutel {
namespace core {

enum class ScoreFunction : int { kSoftmax = 0, kSigmoid = 1, kSqrtSoftplus = 2 };

struct RouteExpertsOptions {
  int64_t k = 1;
  ScoreFunction score = ScoreFunction::kSoftmax;
  bool softmax_after_topk = false;  // weights: softmax over the k chosen logits (score must be softmax)
  int64_t n_group = 0;              // 0: no group limit; else E % n_group == 0
  int64_t topk_group = 0;
  bool renormalize = false;
  double routed_scaling_factor = 1.0;
  bool batch_prioritized = false;
  int64_t capacity = -1;  // slots per expert; -1: dropless
  bool with_loss = false;
};

// The selection bias [E] in float32 or float64 (at most one pointer set; none: no bias).
struct SelectionBias {
  const float* f32 = nullptr;
  const double* f64 = nullptr;
};

// Tokens per chunk: the first CUDA kernel routes one chunk per block (one token per warp at a time)
// and sums the loss's affinities per chunk, so the chunk also fixes that summation order.  8 (one
// token per warp), or more so that there are at most 1024 chunks (the scan reads chunks * k * E
// counts per call), up to 256 (32 per warp; kernels/kernel_abi.h's TUTEL_ROUTE_MAX_CHUNK_TOKENS).
inline int64_t route_experts_chunk_tokens(int64_t tokens) {
  constexpr int64_t kWarps = 8, kMaxChunks = 1024, kMaxPerWarp = 32;
  const int64_t per_warp = (tokens + kWarps * kMaxChunks - 1) / (kWarps * kMaxChunks);
  return kWarps * (per_warp < 1 ? 1 : per_warp > kMaxPerWarp ? kMaxPerWarp : per_warp);
}

// Chunks of route_experts_chunk_tokens tokens; at least one, so that a call without tokens still
// writes its per-expert results.
inline int64_t route_experts_chunks(int64_t tokens) {
  const int64_t chunk = route_experts_chunk_tokens(tokens);
  const int64_t chunks = (tokens + chunk - 1) / chunk;
  return chunks < 1 ? 1 : chunks;
}

// Rows of the static grouped buffer: T k when dropless, else E * capacity.
inline int64_t route_experts_rows(int64_t tokens, int64_t experts, int64_t k, int64_t capacity) {
  return capacity < 0 ? tokens * k : experts * capacity;
}

template <class A>
struct RouteExpertsResult {
  int32_t* expert_ids;         // [k, T]
  A* weights;                  // [k, T]
  int32_t* locations;          // [k, T] GShard slot (>= capacity: dropped)
  int32_t* counts;             // [k, E] choices per (choice, expert) before capacity
  int64_t* dispatch_count;     // [E] choices per expert before capacity
  int32_t* grouped_locations;  // [k, T] row in the grouped buffer, or rows (dropped)
  int32_t* ends;               // [E] cumulative kept rows per expert
  int32_t* row_choices;        // [rows] the choice j * T + t of each row; k * T for an unused row
  A* loss;                     // [1]
};

// For every token of logits [T, E] (S: float, double, bfloat16, float16; A = acc_t<S>):
//   scores     s = softmax(z), sigmoid(z) or sqrt(softplus(z)) (softplus(z) = z above 20), in A;
//   choice     c = round(round(s) + round(b)) (with softmax_after_topk: round(z + round(b))), where
//              round stores into S and b is the selection bias (no bias: c = round(s) or z);
//   groups     with n_group: a group's score is round(best c + second best c) (the best alone for
//              single-expert groups); experts outside the topk_group best groups get c = -inf;
//   choices    the k experts with the largest c: NaN first, ties to the lower index (route_topk's
//              rule; group ties to the lower group);
//   weights    u_j = s[e_j] (softmax_after_topk: softmax of the chosen z), divided by
//              max(sum_j u_j, eps(S)) when renormalizing, times routed_scaling_factor; in A;
//   slots      GShard locations (every first choice before any second choice; tokens in order, or
//              by descending top-1 c with batch_prioritized, NaN first, ties by token);
//   plan       grouped_locations = ends[e - 1] + location when location < capacity (always when
//              dropless), else rows; ends = running sum of min(count_e, capacity);
//   loss       E * sum_e mean_t(p[t, e]) * (first choices of e / T) with p = s for softmax scores,
//              s / max(sum_e s, tiny(S)) otherwise; 0 without tokens or with_loss.
template <class S>
void route_experts_forward(const S* logits, int64_t tokens, int64_t experts, const RouteExpertsOptions& options,
                           SelectionBias bias, const RouteExpertsResult<acc_t<S>>& result);

// d logits [T, E] (stored in S) of the forward's weights and loss: grad_weights [k, T] and the
// 0-dim grad_loss (either may be null: no gradient from it), through the score function, the
// renormalisation and scaling and softmax_after_topk's softmax; the choice (bias, groups) has no
// gradient.  counts: the forward's [k, E] (row 0: first choices, the loss's constants).
template <class S>
void route_experts_backward(const acc_t<S>* grad_weights, const acc_t<S>* grad_loss, const S* logits, int64_t tokens,
                            int64_t experts, const int32_t* expert_ids, const int32_t* counts,
                            const RouteExpertsOptions& options, S* grad_logits);

}  // namespace core
}  // namespace tutel
