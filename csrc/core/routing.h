// Top-k expert selection and GShard slot assignment on raw arrays.
//
// Layout conventions shared by every kernel:
//   scores     [tokens, experts]   row-major
//   indices    [k, tokens] int32   indices[j * tokens + t] = j-th choice of token t
//   locations  [k, tokens] int32   slot of that choice inside its expert's buffer
//   counts     [k, experts] int32  how many tokens picked expert e as choice j
#pragma once

#include <cstdint>
#include <vector>

#include "scalar.h"
#include "status.h"

namespace tutel {
namespace core {

// For every token, the k experts with the highest scores, best first.  Ties go
// to the lower expert index; NaN ranks above every number (as in torch.topk).
// gates[j * tokens + t] receives the selected score.
template <class S>
void select_topk(const S* scores, int64_t tokens, int64_t experts, int64_t k,
                 int32_t* indices, S* gates);

// The k best of single rows of n values (A: float or double) under select_topk's ranking, best
// first, reusing its buffers from row to row (one object per thread).
template <class A>
class RowTopK {
 public:
  RowTopK(int64_t n, int64_t k);
  // The indices of the k best of values[0, n), best first; valid until the next call.
  const int32_t* select(const A* values);

 private:
  int64_t n_, k_;
  std::vector<A> best_values_;
  std::vector<int32_t> best_indices_, order_;
};

// Batch-prioritized routing: the order in which tokens claim slots.  Tokens
// with a higher priority (their top-1 score) come first; equal priorities keep
// token order, so the result is deterministic.
template <class S>
void priority_order(const S* priority, int64_t tokens, int32_t* order);

// GShard slot assignment.  Every token's first choice is placed before any
// token's second choice, and so on; within one choice, tokens are placed in
// `order` (token order when order == nullptr).  Thus
//   locations[j, t] = sum_{i<j} counts[i, e] + #{tokens before t in order with choice j == e}
// where e = indices[j, t].  Fails if an index lies outside [0, experts).
Status assign_locations(const int32_t* indices, int64_t tokens, int64_t k, int64_t experts,
                        const int32_t* order, int32_t* locations, int32_t* counts);

// Dropless grouping (routed experts): the T * k choices of expert_ids [T, k] (row-major, any
// integer type I) sorted by expert, stably in the order t * k + j.  Choices whose id lies
// outside [0, experts) are dropped: they sort after every kept one.  Writes
//   locations[j * tokens + t]  the slot of choice (t, j), or tokens * k when dropped  ([k, T])
//   slot_choices[slot]         the choice t * k + j each slot holds (dropped ones too)  ([T k])
//   sorted_ids[slot]           the expert of each slot (experts for the dropped ones)  ([T k])
//   counts[e]                  kept choices of expert e                                ([E])
//   ends[e]                    counts[0] + .. + counts[e]: where expert e's rows end    ([E])
// One counting pass and one placing pass: O(T k + E), no comparison sort.
template <class I>
void group_choices_by_expert(const I* expert_ids, int64_t tokens, int64_t k, int64_t experts, int32_t* locations,
                             int64_t* slot_choices, int64_t* sorted_ids, int64_t* counts, int32_t* ends);

}  // namespace core
}  // namespace tutel
