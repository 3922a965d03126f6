// tutel::route_experts on the CPU: the rules of route_experts.h, every sum in the order the CUDA
// kernels (kernels/route_experts.cu) take it, so that both give the same bits.
#include "route_experts.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "parallel.h"
#include "routing.h"

namespace tutel {
namespace core {
namespace {

constexpr int kWarp = 32;
constexpr int kBlock = 256;

// The larger of two values as a warp's reduction takes it (NaN never wins; ties keep `a`).
template <class A>
inline A max_combine(A a, A b) {
  return b > a ? b : a;
}

// Warp-order sum (see route_experts.h) of value(i) for i in [0, n).
template <class A, class F>
A warp_order_sum(int64_t n, F value) {
  A lanes[kWarp];
  for (A& lane : lanes) lane = A(0);
  for (int64_t i = 0; i < n; ++i) lanes[i % kWarp] += value(i);
  for (int distance = kWarp / 2; distance > 0; distance >>= 1) {
    A next[kWarp];
    for (int lane = 0; lane < kWarp; ++lane) next[lane] = lanes[lane] + lanes[lane ^ distance];
    for (int lane = 0; lane < kWarp; ++lane) lanes[lane] = next[lane];
  }
  return lanes[0];
}

// The maximum a warp's butterfly gives lane 0 (-inf when every value is NaN or n == 0).
template <class A, class F>
A warp_order_max(int64_t n, F value) {
  A lanes[kWarp];
  for (A& lane : lanes) lane = -std::numeric_limits<A>::infinity();
  for (int64_t i = 0; i < n; ++i) lanes[i % kWarp] = max_combine(lanes[i % kWarp], value(i));
  for (int distance = kWarp / 2; distance > 0; distance >>= 1) {
    A next[kWarp];
    for (int lane = 0; lane < kWarp; ++lane) next[lane] = max_combine(lanes[lane], lanes[lane ^ distance]);
    for (int lane = 0; lane < kWarp; ++lane) lanes[lane] = next[lane];
  }
  return lanes[0];
}

// Block-order sum of value(i) for i in [0, n).
template <class A, class F>
A block_order_sum(int64_t n, F value) {
  std::vector<A> partials(kBlock, A(0));
  for (int64_t i = 0; i < n; ++i) partials[size_t(i % kBlock)] += value(i);
  A total = A(0);
  for (int warp = 0; warp < kBlock / kWarp; ++warp)
    total += warp_order_sum<A>(kWarp, [&](int64_t lane) { return partials[size_t(warp * kWarp + lane)]; });
  return total;
}

// PyTorch's finfo(S).eps (normalize_gates' clamp) and finfo(S).tiny (scoring.affinity's clamp).
template <class S>
struct Limits;
template <>
struct Limits<float> {
  static float eps() { return std::ldexp(1.0f, -23); }
  static float tiny() { return std::ldexp(1.0f, -126); }
};
template <>
struct Limits<double> {
  static double eps() { return std::ldexp(1.0, -52); }
  static double tiny() { return std::ldexp(1.0, -1022); }
};
template <>
struct Limits<bfloat16> {
  static float eps() { return std::ldexp(1.0f, -7); }
  static float tiny() { return std::ldexp(1.0f, -126); }
};
template <>
struct Limits<float16> {
  static float eps() { return std::ldexp(1.0f, -10); }
  static float tiny() { return std::ldexp(1.0f, -14); }
};

// One token's scores: s(e) from its logits and the softmax's maximum and sum.
template <class S>
struct TokenScores {
  using A = acc_t<S>;
  const S* row;
  int64_t experts;
  ScoreFunction score;
  A max = A(0), sum = A(1);  // softmax: the largest logit, sum of exp(z - max)
  A norm = A(1);             // sum of s over the experts (the loss's affinity of non-softmax scores)

  A z(int64_t e) const { return Scalar<S>::load(row[e]); }

  A s(int64_t e) const {
    const A x = z(e);
    if (score == ScoreFunction::kSoftmax) return std::exp(x - max) / sum;
    if (score == ScoreFunction::kSigmoid) return A(1) / (A(1) + std::exp(-x));
    return std::sqrt(x > A(20) ? x : std::log1p(std::exp(x)));
  }

  // d s / d z at expert e.
  A ds(int64_t e) const {
    const A x = z(e), value = s(e);
    if (score == ScoreFunction::kSigmoid) return value * (A(1) - value);
    const A ez = std::exp(x);
    const A softplus_slope = x > A(20) ? A(1) : ez / (ez + A(1));
    return softplus_slope / (A(2) * value);
  }

  // The loss's affinity p[t, e].
  A affinity(int64_t e, A tiny) const {
    if (score == ScoreFunction::kSoftmax) return s(e);
    return s(e) / (norm < tiny ? tiny : norm);
  }

  // max / sum (softmax) and norm (non-softmax), as far as `softmax_stats` and `norm_needed` ask.
  void measure(bool softmax_stats, bool norm_needed) {
    if (softmax_stats) {
      max = warp_order_max<A>(experts, [&](int64_t e) { return z(e); });
      sum = warp_order_sum<A>(experts, [&](int64_t e) { return std::exp(z(e) - max); });
    }
    if (norm_needed) norm = warp_order_sum<A>(experts, [&](int64_t e) { return s(e); });
  }
};

template <class S>
acc_t<S> round_to_storage(acc_t<S> value) {
  return Scalar<S>::load(Scalar<S>::store(value));
}

template <class S>
acc_t<S> bias_value(SelectionBias bias, int64_t e) {
  using A = acc_t<S>;
  return round_to_storage<S>(bias.f32 != nullptr ? A(bias.f32[e]) : A(bias.f64[e]));
}

// Whether the softmax's max and sum are needed: for softmax scores, unless only the chosen logits
// are used (softmax_after_topk without the loss).
bool needs_softmax_stats(const RouteExpertsOptions& o, bool loss) {
  return o.score == ScoreFunction::kSoftmax && (!o.softmax_after_topk || loss);
}

// The choice scores c of a token, group limit applied; one object per thread (it keeps its buffers).
template <class S>
class ChoiceScores {
 public:
  using A = acc_t<S>;

  ChoiceScores(int64_t experts, const RouteExpertsOptions& o, SelectionBias bias)
      : o_(o), bias_(bias), group_size_(o.n_group > 0 ? experts / o.n_group : experts), choice_(size_t(experts)),
        group_scores_(size_t(o.n_group > 0 ? o.n_group : 0)), keep_(group_scores_.size()),
        pair_(group_size_, group_size_ < 2 ? 1 : 2), groups_(o.n_group > 0 ? o.n_group : 1, o.topk_group) {}

  // c [E] of `token`.
  const A* of(const TokenScores<S>& token) {
    const bool has_bias = bias_.f32 != nullptr || bias_.f64 != nullptr;
    for (int64_t e = 0; e < token.experts; ++e) {
      A c = o_.softmax_after_topk ? token.z(e) : round_to_storage<S>(token.s(e));
      if (has_bias) c = round_to_storage<S>(c + bias_value<S>(bias_, e));
      choice_[size_t(e)] = c;
    }
    if (o_.n_group > 0) limit_groups(token.experts);
    return choice_.data();
  }

 private:
  void limit_groups(int64_t experts) {
    for (int64_t g = 0; g < o_.n_group; ++g) {
      const A* group = choice_.data() + g * group_size_;
      const int32_t* best = pair_.select(group);
      group_scores_[size_t(g)] = group_size_ < 2 ? group[best[0]] : round_to_storage<S>(group[best[0]] + group[best[1]]);
    }
    const int32_t* kept = groups_.select(group_scores_.data());
    std::fill(keep_.begin(), keep_.end(), 0);
    for (int64_t i = 0; i < o_.topk_group; ++i) keep_[size_t(kept[i])] = 1;
    for (int64_t e = 0; e < experts; ++e)
      if (!keep_[size_t(e / group_size_)]) choice_[size_t(e)] = -std::numeric_limits<A>::infinity();
  }

  const RouteExpertsOptions& o_;
  SelectionBias bias_;
  int64_t group_size_;
  std::vector<A> choice_, group_scores_;
  std::vector<char> keep_;
  RowTopK<A> pair_, groups_;
};

// u_j of one token's chosen experts (before renormalisation and scaling), into u[k].
template <class S>
void chosen_scores(const TokenScores<S>& token, const RouteExpertsOptions& o, const int32_t* chosen, int64_t stride,
                   acc_t<S>* u) {
  using A = acc_t<S>;
  const int64_t k = o.k;
  if (!o.softmax_after_topk) {
    for (int64_t j = 0; j < k; ++j) u[j] = token.s(chosen[j * stride]);
    return;
  }
  A top = -std::numeric_limits<A>::infinity();
  for (int64_t j = 0; j < k; ++j) top = max_combine(top, token.z(chosen[j * stride]));
  A sum = A(0);
  for (int64_t j = 0; j < k; ++j) sum += std::exp(token.z(chosen[j * stride]) - top);
  for (int64_t j = 0; j < k; ++j) u[j] = std::exp(token.z(chosen[j * stride]) - top) / sum;
}

// normalize_gates' denominator max(sum_j u_j, eps) (NaN stays NaN), and whether it was clamped.
template <class S>
acc_t<S> weight_denominator(const acc_t<S>* u, int64_t k, bool& clamped) {
  using A = acc_t<S>;
  A sum = A(0);
  for (int64_t j = 0; j < k; ++j) sum += u[j];
  clamped = sum < Limits<S>::eps();
  return clamped ? A(Limits<S>::eps()) : sum;
}

// The batch-prioritized claiming order from the top-1 choice scores (stored in S, as route_topk's gates).
template <class S>
std::vector<int32_t> claiming_order(const std::vector<acc_t<S>>& top_choice) {
  std::vector<S> priority(top_choice.size());
  for (size_t t = 0; t < priority.size(); ++t) priority[t] = Scalar<S>::store(top_choice[t]);
  std::vector<int32_t> order(priority.size());
  priority_order(priority.data(), int64_t(priority.size()), order.data());
  return order;
}

// The grouped-rows plan from the GShard slots: ends, grouped_locations and row_choices.
void grouped_plan(int64_t tokens, int64_t experts, int64_t k, int64_t capacity, const int32_t* expert_ids,
                  const int32_t* locations, const int64_t* dispatch_count, int32_t* ends, int32_t* grouped_locations,
                  int32_t* row_choices) {
  const int64_t rows = route_experts_rows(tokens, experts, k, capacity);
  int64_t running = 0;
  for (int64_t e = 0; e < experts; ++e) {
    running += capacity < 0 ? dispatch_count[e] : std::min<int64_t>(dispatch_count[e], capacity);
    ends[e] = int32_t(running);
  }
  for (int64_t r = running; r < rows; ++r) row_choices[r] = int32_t(k * tokens);
  for (int64_t i = 0; i < k * tokens; ++i) {
    const int32_t e = expert_ids[i], slot = locations[i];
    if (capacity >= 0 && slot >= capacity) {
      grouped_locations[i] = int32_t(rows);
      continue;
    }
    const int32_t row = (e > 0 ? ends[e - 1] : 0) + slot;
    grouped_locations[i] = row;
    row_choices[row] = int32_t(i);
  }
}

// The GShard loss from the tokens' affinities, summed per chunk, then over chunks and experts.
template <class S>
acc_t<S> gshard_loss(const std::vector<TokenScores<S>>& tokens, int64_t experts, const int32_t* first_counts) {
  using A = acc_t<S>;
  const int64_t count = int64_t(tokens.size());
  if (count == 0) return A(0);
  const int64_t chunk = route_experts_chunk_tokens(count), chunks = route_experts_chunks(count);
  const A tiny = Limits<S>::tiny();
  std::vector<A> chunk_sums(size_t(chunks * experts));
  parallel_for(0, chunks, 1, [&](int64_t first_chunk, int64_t last_chunk) {
    for (int64_t c = first_chunk; c < last_chunk; ++c) {
      const int64_t last = std::min(count, (c + 1) * chunk);
      for (int64_t e = 0; e < experts; ++e) {
        A sum = A(0);
        for (int64_t t = c * chunk; t < last; ++t) sum += tokens[size_t(t)].affinity(e, tiny);
        chunk_sums[size_t(c * experts + e)] = sum;
      }
    }
  });
  const A total = block_order_sum<A>(experts, [&](int64_t e) {
    const A column = block_order_sum<A>(chunks, [&](int64_t c) { return chunk_sums[size_t(c * experts + e)]; });
    return (column / A(count)) * (A(first_counts[e]) / A(count));
  });
  return total * A(experts);
}

}  // namespace

template <class S>
void route_experts_forward(const S* logits, int64_t tokens, int64_t experts, const RouteExpertsOptions& o,
                           SelectionBias bias, const RouteExpertsResult<acc_t<S>>& out) {
  using A = acc_t<S>;
  const int64_t k = o.k;
  const bool loss = o.with_loss && tokens > 0;
  std::vector<TokenScores<S>> scores(static_cast<size_t>(tokens));
  std::vector<A> top_choice(size_t(o.batch_prioritized ? tokens : 0));
  parallel_for(0, tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, experts)), [&](int64_t first, int64_t last) {
    std::vector<A> u(static_cast<size_t>(k));
    ChoiceScores<S> choices(experts, o, bias);
    RowTopK<A> top(experts, k);
    for (int64_t t = first; t < last; ++t) {
      TokenScores<S>& token = scores[size_t(t)];
      token = TokenScores<S>{logits + t * experts, experts, o.score};
      token.measure(needs_softmax_stats(o, loss), loss && o.score != ScoreFunction::kSoftmax);
      const A* choice = choices.of(token);
      const int32_t* chosen = top.select(choice);
      for (int64_t j = 0; j < k; ++j) out.expert_ids[j * tokens + t] = chosen[j];
      if (o.batch_prioritized) top_choice[size_t(t)] = choice[chosen[0]];
      chosen_scores(token, o, out.expert_ids + t, tokens, u.data());
      bool clamped = false;
      const A denominator = o.renormalize ? weight_denominator<S>(u.data(), k, clamped) : A(1);
      for (int64_t j = 0; j < k; ++j) {
        const A r = o.renormalize ? u[size_t(j)] / denominator : u[size_t(j)];
        out.weights[j * tokens + t] = r * A(o.routed_scaling_factor);
      }
    }
  });
  std::vector<int32_t> order;
  if (o.batch_prioritized && tokens > 0) order = claiming_order<S>(top_choice);
  // Every index was chosen above, so the assignment cannot fail.
  (void)assign_locations(out.expert_ids, tokens, k, experts, order.empty() ? nullptr : order.data(), out.locations,
                         out.counts);
  for (int64_t e = 0; e < experts; ++e) {
    int64_t total = 0;
    for (int64_t j = 0; j < k; ++j) total += out.counts[j * experts + e];
    out.dispatch_count[e] = total;
  }
  grouped_plan(tokens, experts, k, o.capacity, out.expert_ids, out.locations, out.dispatch_count, out.ends,
               out.grouped_locations, out.row_choices);
  *out.loss = loss ? gshard_loss(scores, experts, out.counts) : A(0);
}

template <class S>
void route_experts_backward(const acc_t<S>* grad_weights, const acc_t<S>* grad_loss, const S* logits, int64_t tokens,
                            int64_t experts, const int32_t* expert_ids, const int32_t* counts,
                            const RouteExpertsOptions& o, S* grad_logits) {
  using A = acc_t<S>;
  const int64_t k = o.k;
  const bool loss = o.with_loss && grad_loss != nullptr && tokens > 0;
  const A loss_grad = loss ? *grad_loss : A(0);
  const A scale = A(o.routed_scaling_factor);
  const A tiny = Limits<S>::tiny();
  parallel_for(0, tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, experts)), [&](int64_t first, int64_t last) {
    std::vector<A> u(static_cast<size_t>(k)), gu(static_cast<size_t>(k));
    std::vector<int64_t> chosen_as(size_t(experts), -1);  // e -> j
    for (int64_t t = first; t < last; ++t) {
      TokenScores<S> token{logits + t * experts, experts, o.score};
      token.measure(needs_softmax_stats(o, loss), loss && o.score != ScoreFunction::kSoftmax);
      const int32_t* chosen = expert_ids + t;
      chosen_scores(token, o, chosen, tokens, u.data());
      // d L / d u_j through the scaling and the renormalisation.
      bool clamped = false;
      const A denominator = o.renormalize ? weight_denominator<S>(u.data(), k, clamped) : A(1);
      A dot = A(0);
      for (int64_t j = 0; j < k; ++j) dot += (grad_weights ? grad_weights[j * tokens + t] : A(0)) * scale * u[j];
      for (int64_t j = 0; j < k; ++j) {
        const A gr = (grad_weights ? grad_weights[j * tokens + t] : A(0)) * scale;
        gu[j] = !o.renormalize ? gr : gr / denominator - (clamped ? A(0) : dot / (denominator * denominator));
      }
      // Sums over the chosen experts (sequential in j) and over all experts (warp order).
      A chosen_dot = A(0);
      for (int64_t j = 0; j < k; ++j) chosen_dot += gu[j] * (o.softmax_after_topk ? u[j] : token.s(chosen[j * tokens]));
      auto loss_slope = [&](int64_t e) { return loss_grad * (A(experts) * (A(counts[e]) / A(tokens)) / A(tokens)); };
      const A loss_dot = !loss ? A(0) : warp_order_sum<A>(experts, [&](int64_t e) { return loss_slope(e) * token.s(e); });
      for (int64_t j = 0; j < k; ++j) chosen_as[size_t(chosen[j * tokens])] = j;
      for (int64_t e = 0; e < experts; ++e) {
        const int64_t j = chosen_as[size_t(e)];
        A grad = A(0);
        if (o.softmax_after_topk) {
          if (j >= 0) grad = u[j] * (gu[j] - chosen_dot);
          if (loss) grad = grad + token.s(e) * (loss_slope(e) - loss_dot);
        } else if (o.score == ScoreFunction::kSoftmax) {
          A g = j >= 0 ? gu[j] : A(0);
          if (loss) g = g + loss_slope(e);
          grad = token.s(e) * (g - (loss ? chosen_dot + loss_dot : chosen_dot));
        } else {
          A g = j >= 0 ? gu[j] : A(0);
          if (loss) {
            const bool norm_clamped = token.norm < tiny;
            const A norm = norm_clamped ? tiny : token.norm;
            g = g + (loss_slope(e) / norm - (norm_clamped ? A(0) : loss_dot / (norm * norm)));
          }
          grad = g * token.ds(e);
        }
        grad_logits[t * experts + e] = Scalar<S>::store(grad);
      }
      for (int64_t j = 0; j < k; ++j) chosen_as[size_t(chosen[j * tokens])] = -1;
    }
  });
}

#define TUTEL_INSTANTIATE_ROUTE_EXPERTS(S)                                                                        \
  template void route_experts_forward<S>(const S*, int64_t, int64_t, const RouteExpertsOptions&, SelectionBias,   \
                                         const RouteExpertsResult<acc_t<S>>&);                                    \
  template void route_experts_backward<S>(const acc_t<S>*, const acc_t<S>*, const S*, int64_t, int64_t,          \
                                          const int32_t*, const int32_t*, const RouteExpertsOptions&, S*);

TUTEL_INSTANTIATE_ROUTE_EXPERTS(float)
TUTEL_INSTANTIATE_ROUTE_EXPERTS(double)
TUTEL_INSTANTIATE_ROUTE_EXPERTS(bfloat16)
TUTEL_INSTANTIATE_ROUTE_EXPERTS(float16)

}  // namespace core
}  // namespace tutel
