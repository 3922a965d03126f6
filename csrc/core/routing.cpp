#include "routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "parallel.h"

namespace tutel {
namespace core {
namespace {

// a ranks strictly above b.  NaN ranks above every number and equal to NaN,
// which keeps this a strict weak ordering (std::sort requires one).
template <class A>
inline bool ranks_above(A a, A b) {
  if (std::isnan(a)) return !std::isnan(b);
  return a > b;  // false whenever b is NaN
}

// Keeps the k best (value, index) pairs seen so far, sorted best first.
// Elements arrive in increasing index order, so an equal value never displaces
// an earlier one: ties resolve to the lower index.
template <class A>
inline void insert_candidate(A value, int32_t index, int64_t k, int64_t& filled, A* best_values,
                             int32_t* best_indices) {
  if (filled == k && !ranks_above(value, best_values[k - 1])) return;
  int64_t pos = filled < k ? filled : k - 1;
  while (pos > 0 && ranks_above(value, best_values[pos - 1])) {
    best_values[pos] = best_values[pos - 1];
    best_indices[pos] = best_indices[pos - 1];
    --pos;
  }
  best_values[pos] = value;
  best_indices[pos] = index;
  if (filled < k) ++filled;
}

// Above this k, a partial sort beats repeated insertion.
constexpr int64_t kInsertionLimit = 32;

// order[0, k) = the k best indices of values[0, n) by a partial sort (order holds n entries).
template <class A>
void partial_sort_top_k(const A* values, int64_t k, std::vector<int32_t>& order) {
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    if (ranks_above(values[a], values[b])) return true;
    if (ranks_above(values[b], values[a])) return false;
    return a < b;
  });
}

// Scores examined at once by the skip test below, and the expert count from
// which the test pays: with few experts the list's k-th best is still low when
// the blocks arrive, most blocks pass and the test is extra work (slower at 64
// experts, much faster at 1024: docs/performance.md, "Routing on the CPU").
constexpr int64_t kScanBlock = 16;
constexpr int64_t kScanMinExperts = 256;

// Whether any of kScanBlock scores could enter a full top-k list whose k-th best is
// `threshold`: for a number threshold that is exactly "some value is NaN or
// greater", i.e. !(v <= threshold).  (A NaN threshold lets every block through;
// insert_candidate then turns every value away, as it must.)  Branch-free so that
// it vectorises (GCC does so only when it is not inlined into the row loop): most
// blocks of a row fail it once the list holds large scores.
template <class S>
__attribute__((noinline)) bool block_may_enter(const S* values, acc_t<S> threshold) {
  int at_most_threshold = 0;
  for (int i = 0; i < int(kScanBlock); ++i) at_most_threshold += Scalar<S>::load(values[i]) <= threshold;
  return at_most_threshold != int(kScanBlock);
}

}  // namespace

template <class S>
void select_topk(const S* scores, int64_t tokens, int64_t experts, int64_t k,
                 int32_t* indices, S* gates) {
  using A = acc_t<S>;
  int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, experts));
  parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {
    std::vector<A> best_values(k);
    std::vector<int32_t> best_indices(k);
    std::vector<int32_t> order(k > kInsertionLimit ? experts : 0);
    std::vector<A> row_values(k > kInsertionLimit ? experts : 0);
    for (int64_t t = first; t < last; ++t) {
      const S* row = scores + t * experts;
      if (k <= kInsertionLimit) {
        int64_t filled = 0, e = 0;
        for (; e < experts && filled < k; ++e)
          insert_candidate(Scalar<S>::load(row[e]), int32_t(e), k, filled, best_values.data(),
                           best_indices.data());
        const bool skip_blocks = experts >= kScanMinExperts;
        for (; e < experts; e += kScanBlock) {
          const int64_t end = std::min(e + kScanBlock, experts);
          if (skip_blocks && end - e == kScanBlock && !block_may_enter(row + e, best_values[k - 1])) continue;
          for (int64_t i = e; i < end; ++i)
            insert_candidate(Scalar<S>::load(row[i]), int32_t(i), k, filled, best_values.data(),
                             best_indices.data());
        }
      } else {
        for (int64_t e = 0; e < experts; ++e) row_values[e] = Scalar<S>::load(row[e]);
        partial_sort_top_k(row_values.data(), k, order);
        for (int64_t j = 0; j < k; ++j) best_indices[j] = order[j];
      }
      for (int64_t j = 0; j < k; ++j) {
        indices[j * tokens + t] = best_indices[j];
        gates[j * tokens + t] = row[best_indices[j]];
      }
    }
  });
}

template <class A>
RowTopK<A>::RowTopK(int64_t n, int64_t k)
    : n_(n), k_(k), best_values_(k), best_indices_(k), order_(k > kInsertionLimit ? n : 0) {}

template <class A>
const int32_t* RowTopK<A>::select(const A* values) {
  if (k_ > kInsertionLimit) {
    partial_sort_top_k(values, k_, order_);
    return order_.data();
  }
  int64_t filled = 0;
  for (int64_t e = 0; e < n_; ++e)
    insert_candidate(values[e], int32_t(e), k_, filled, best_values_.data(), best_indices_.data());
  return best_indices_.data();
}

template class RowTopK<float>;
template class RowTopK<double>;

Status assign_locations(const int32_t* indices, int64_t tokens, int64_t k, int64_t experts,
                        const int32_t* order, int32_t* locations, int32_t* counts) {
  // Two passes over contiguous pieces of the (ordered) token sequence: count
  // per piece, turn counts into starting offsets, then hand out slots.
  const int64_t pieces = useful_pieces(tokens, 4096);
  const int64_t table = k * experts;
  std::vector<int32_t> offsets(pieces * table, 0);
  StatusCollector status;

  parallel_pieces(tokens, pieces, [&](int64_t p, int64_t first, int64_t last) {
    int32_t* histogram = offsets.data() + p * table;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t* choice = indices + j * tokens;
      int32_t* hist_j = histogram + j * experts;
      for (int64_t pos = first; pos < last; ++pos) {
        int64_t t = order ? order[pos] : pos;
        int32_t e = choice[t];
        if (e < 0 || e >= experts) {
          status.report(StatusCode::kExpertIndexOutOfRange, j, t, e);
          continue;
        }
        ++hist_j[e];
      }
    }
  });
  if (status.failed()) return status.result();

  // GShard order: all of choice 0, then all of choice 1, ...; inside one choice,
  // piece by piece.
  for (int64_t e = 0; e < experts; ++e) {
    int32_t running = 0;
    for (int64_t j = 0; j < k; ++j) {
      int32_t choice_total = 0;
      for (int64_t p = 0; p < pieces; ++p) {
        int32_t& cell = offsets[p * table + j * experts + e];
        int32_t piece_count = cell;
        cell = running;
        running += piece_count;
        choice_total += piece_count;
      }
      counts[j * experts + e] = choice_total;
    }
  }

  parallel_pieces(tokens, pieces, [&](int64_t p, int64_t first, int64_t last) {
    int32_t* next_slot = offsets.data() + p * table;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t* choice = indices + j * tokens;
      int32_t* where = locations + j * tokens;
      int32_t* next_j = next_slot + j * experts;
      for (int64_t pos = first; pos < last; ++pos) {
        int64_t t = order ? order[pos] : pos;
        where[t] = next_j[choice[t]]++;
      }
    }
  });
  return Status{};
}

#define TUTEL_INSTANTIATE_ROUTING(S) \
  template void select_topk<S>(const S*, int64_t, int64_t, int64_t, int32_t*, S*);

TUTEL_INSTANTIATE_ROUTING(float)
TUTEL_INSTANTIATE_ROUTING(double)
TUTEL_INSTANTIATE_ROUTING(bfloat16)
TUTEL_INSTANTIATE_ROUTING(float16)

template <class I>
void group_choices_by_expert(const I* expert_ids, int64_t tokens, int64_t k, int64_t experts, int32_t* locations,
                             int64_t* slot_choices, int64_t* sorted_ids, int64_t* counts, int32_t* ends) {
  const int64_t total = tokens * k;
  auto kept = [experts](I e) { return e >= 0 && int64_t(e) < experts; };
  std::fill(counts, counts + experts, int64_t(0));
  for (int64_t i = 0; i < total; ++i)
    if (kept(expert_ids[i])) ++counts[expert_ids[i]];
  // next[e]: the next free slot of expert e; the dropped choices fill the tail in order.
  std::vector<int64_t> next(experts);
  int64_t running = 0;
  for (int64_t e = 0; e < experts; ++e) {
    next[e] = running;
    running += counts[e];
    ends[e] = int32_t(running);
  }
  std::fill(sorted_ids + running, sorted_ids + total, experts);
  int64_t next_dropped = running;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const I e = expert_ids[t * k + j];
      if (!kept(e)) {
        locations[j * tokens + t] = int32_t(total);
        slot_choices[next_dropped++] = t * k + j;
        continue;
      }
      const int64_t slot = next[e]++;
      locations[j * tokens + t] = int32_t(slot);
      slot_choices[slot] = t * k + j;
      sorted_ids[slot] = int64_t(e);
    }
  }
}

template void group_choices_by_expert<int32_t>(const int32_t*, int64_t, int64_t, int64_t, int32_t*, int64_t*,
                                               int64_t*, int64_t*, int32_t*);
template void group_choices_by_expert<int64_t>(const int64_t*, int64_t, int64_t, int64_t, int32_t*, int64_t*,
                                               int64_t*, int64_t*, int32_t*);

}  // namespace core
}  // namespace tutel
