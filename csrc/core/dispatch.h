// Dispatch (encode) and combine (decode) between token rows and expert slots.
//
// The expert buffer is [experts, capacity, M] row-major: slot (e, l) is row
// e * capacity + l.  A choice whose location is >= capacity was dropped: it
// reads and writes nothing.  Every kernel here is one of two row movements,
// optionally fused with the dot products that the gate gradient needs:
//
//   gather_slots:  out[t]    = sum_j w[j,t] * rows[slot(j,t)]     (decode, encode backward)
//   scatter_slots: out[slot] = w[j,t] * src[t]                    (encode, decode backward)
//
// and, when `dots` is given, dots[j,t] = < rows-or-other at slot(j,t), token row t >.
#pragma once

#include <cstdint>

#include "choice_weights.h"
#include "scalar.h"
#include "status.h"

namespace tutel {
namespace core {

struct SlotTable {
  const int32_t* indices;    // [k, tokens]; nullptr: every choice's expert is 0 (the grouped layout)
  const int32_t* locations;  // [k, tokens]
  int64_t k;
  int64_t tokens;
  int64_t experts;
  int64_t capacity;
};

// out[t] = sum over kept choices j of w[j,t] * rows[slot(j,t)]; zero if all
// choices of t were dropped.  w (see ChoiceWeights) without data means weight 1.
// If dots != nullptr: dots[j,t] = <rows[slot(j,t)], other[t]>, 0 when dropped.
template <class T>
Status gather_slots(const T* rows, int64_t M, const SlotTable& table, const ChoiceWeights& weights,
                    const T* other, acc_t<T>* dots, T* out);

// out[slot(j,t)] = w[j,t] * src[t]; unclaimed slots are zero; contributions of
// several choices to one slot are summed in (choice, token) order.
// If dots != nullptr: dots[j,t] = <other[slot(j,t)], src[t]>, 0 when dropped.
template <class T>
Status scatter_slots(const T* src, int64_t M, const SlotTable& table, const ChoiceWeights& weights,
                     const T* other, acc_t<T>* dots, T* out);

}  // namespace core
}  // namespace tutel
