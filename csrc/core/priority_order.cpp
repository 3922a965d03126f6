// Batch-prioritized routing order: tokens by descending priority, ties in token
// order, NaN first (the ranking select_topk uses).
//
// A stable least-significant-digit radix sort on keys that order like the
// priorities: O(T) per 8-bit digit instead of a comparison sort's O(T log T),
// with every pass split into pieces that count and scatter in parallel.  Digits
// on which all keys agree (common: probabilities share sign and most exponent
// bits) are skipped.
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "routing.h"

namespace tutel {
namespace core {
namespace {

constexpr int kDigitBits = 8;
constexpr int kDigits = 1 << kDigitBits;

// An unsigned key that is smaller the higher `value` ranks: NaN gets 0, then
// +inf, ..., -inf.  -0 and +0 get the same key (they are equal priorities).
template <class U, class A>
U descending_key(A value) {
  static_assert(sizeof(U) == sizeof(A), "key and value have the same width");
  if (std::isnan(value)) return 0;
  value = value + A(0);  // -0 becomes +0
  U bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const U sign = U(1) << (8 * sizeof(U) - 1);
  const U ascending = (bits & sign) ? U(~bits) : U(bits | sign);  // grows with the value
  return U(~ascending);  // never 0: that would be the all-ones NaN pattern
}

template <class U>
void radix_sort(std::vector<U>& keys, int32_t* order, int64_t n) {
  const int64_t pieces = useful_pieces(n, 1 << 14);
  std::vector<int64_t> offsets(pieces * kDigits);
  std::vector<U> other_keys(n);
  std::vector<int32_t> other_order(n);
  int32_t* current_order = order;
  int32_t* next_order = other_order.data();
  for (int shift = 0; shift < int(8 * sizeof(U)); shift += kDigitBits) {
    std::fill(offsets.begin(), offsets.end(), 0);
    parallel_pieces(n, pieces, [&](int64_t p, int64_t first, int64_t last) {
      int64_t* count = offsets.data() + p * kDigits;
      for (int64_t i = first; i < last; ++i) ++count[(keys[i] >> shift) & (kDigits - 1)];
    });
    // Digit-major, piece-minor starting positions keep the sort stable.
    int64_t running = 0;
    bool one_digit = false;
    for (int d = 0; d < kDigits; ++d) {
      int64_t digit_total = 0;
      for (int64_t p = 0; p < pieces; ++p) {
        int64_t count = offsets[p * kDigits + d];
        offsets[p * kDigits + d] = running;
        running += count;
        digit_total += count;
      }
      one_digit = one_digit || digit_total == n;
    }
    if (one_digit) continue;  // every key has this digit: the pass would not move anything
    parallel_pieces(n, pieces, [&](int64_t p, int64_t first, int64_t last) {
      int64_t* next = offsets.data() + p * kDigits;
      for (int64_t i = first; i < last; ++i) {
        int64_t at = next[(keys[i] >> shift) & (kDigits - 1)]++;
        other_keys[at] = keys[i];
        next_order[at] = current_order[i];
      }
    });
    keys.swap(other_keys);
    std::swap(current_order, next_order);
  }
  if (current_order != order) std::copy(current_order, current_order + n, order);
}

}  // namespace

template <class S>
void priority_order(const S* priority, int64_t tokens, int32_t* order) {
  using A = acc_t<S>;
  using U = typename std::conditional<sizeof(A) == 8, uint64_t, uint32_t>::type;
  std::vector<U> keys(tokens);
  parallel_for(0, tokens, 1 << 14, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) keys[t] = descending_key<U>(Scalar<S>::load(priority[t]));
  });
  std::iota(order, order + tokens, 0);
  radix_sort(keys, order, tokens);
}

template void priority_order<float>(const float*, int64_t, int32_t*);
template void priority_order<double>(const double*, int64_t, int32_t*);
template void priority_order<bfloat16>(const bfloat16*, int64_t, int32_t*);
template void priority_order<float16>(const float16*, int64_t, int32_t*);

}  // namespace core
}  // namespace tutel
