#include "dispatch.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "row_kernels.h"

namespace tutel {
namespace core {
namespace {

// Rows per parallel chunk: enough elements per chunk to amortise scheduling.
inline int64_t row_grain(int64_t M) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, M)); }

// Reads (choice j, token t) of the table; returns the slot row, -1 when the
// choice was dropped (location >= capacity), or reports bad data and returns -2.
inline int64_t slot_of(const SlotTable& s, int64_t j, int64_t t, StatusCollector& status) {
  int64_t at = j * s.tokens + t;
  int32_t e = s.indices != nullptr ? s.indices[at] : 0;
  int32_t l = s.locations[at];
  if (e < 0 || e >= s.experts) {
    status.report(StatusCode::kExpertIndexOutOfRange, j, t, e);
    return -2;
  }
  if (l < 0) {
    status.report(StatusCode::kNegativeLocation, j, t, l);
    return -2;
  }
  if (l >= s.capacity) return -1;
  return int64_t(e) * s.capacity + l;
}

template <class T>
inline void zero_row(T* dst, int64_t M) {
  if (M == 0) return;  // empty rows may come with null data pointers; memset(nullptr, 0, 0) is undefined
  std::memset(static_cast<void*>(dst), 0, sizeof(T) * M);
}

// dst += w * src, rounding once per element (only for slots shared by several choices).
template <class T>
inline void add_scaled_row(T* dst, const T* src, acc_t<T> w, int64_t M) {
  for (int64_t m = 0; m < M; ++m)
    dst[m] = Scalar<T>::store(Scalar<T>::load(dst[m]) + w * Scalar<T>::load(src[m]));
}

// dst = sum_i w_i * rows[i]; a single row of weight one is copied as it is.
template <class T>
inline void combine_rows(const RowKernels<T>& kernels, T* dst, const T* const* rows, const acc_t<T>* weights,
                         int n, int64_t M) {
  if (M == 0) return;  // empty rows may come with null data pointers; memcpy(.., nullptr, 0) is undefined
  if (n == 1 && (weights == nullptr || weights[0] == acc_t<T>(1))) {
    std::memcpy(static_cast<void*>(dst), rows[0], sizeof(T) * M);
    return;
  }
  kernels.weighted_sum(dst, rows, weights, n, M);
}

}  // namespace

template <class T>
Status gather_slots(const T* rows, int64_t M, const SlotTable& s, const ChoiceWeights& weights,
                    const T* other, acc_t<T>* dots, T* out) {
  using A = acc_t<T>;
  const RowKernels<T>& kernels = row_kernels<T>();
  StatusCollector status;
  parallel_for(0, s.tokens, row_grain(M), [&](int64_t first, int64_t last) {
    // The kept choices of one token: their slot rows, weights and choice numbers.
    std::vector<const T*> kept_rows(s.k);
    std::vector<A> kept_weights(s.k);
    std::vector<int64_t> kept_choices(s.k);
    for (int64_t t = first; t < last; ++t) {
      int kept = 0;
      for (int64_t j = 0; j < s.k; ++j) {
        int64_t slot = slot_of(s, j, t, status);
        if (dots) dots[j * s.tokens + t] = A(0);
        if (slot < 0) continue;
        kept_rows[kept] = rows + slot * M;
        kept_weights[kept] = choice_weight<T>(weights, j, t);
        kept_choices[kept] = j;
        ++kept;
      }
      T* dst = out + t * M;
      if (kept == 0) {
        zero_row(dst, M);
        continue;
      }
      // One pass: every kept row is read once and the sum is rounded once.
      combine_rows(kernels, dst, kept_rows.data(), weights.data ? kept_weights.data() : nullptr, kept, M);
      if (dots)
        for (int i = 0; i < kept; ++i)
          dots[kept_choices[i] * s.tokens + t] = kernels.dot(kept_rows[i], other + t * M, M);
    }
  });
  return status.result();
}

template <class T>
Status scatter_slots(const T* src, int64_t M, const SlotTable& s, const ChoiceWeights& weights,
                     const T* other, acc_t<T>* dots, T* out) {
  using A = acc_t<T>;
  const RowKernels<T>& kernels = row_kernels<T>();
  const int64_t entries = s.k * s.tokens;
  const int64_t slots = s.experts * s.capacity;
  StatusCollector status;

  // owner[slot] = j * tokens + t of a choice that names the slot, or -1.  Claims
  // are plain (relaxed) stores; whether two choices named one slot is found
  // afterwards by counting: without sharing, every kept choice owns a slot.
  std::vector<int64_t> owner(slots, -1);
  std::atomic<int64_t> kept_choices{0};
  parallel_for(0, entries, 16384, [&](int64_t first, int64_t last) {
    int64_t kept = 0;
    for (int64_t at = first; at < last; ++at) {
      int64_t slot = slot_of(s, at / s.tokens, at % s.tokens, status);
      if (slot < 0) continue;
      __atomic_store_n(&owner[slot], at, __ATOMIC_RELAXED);
      ++kept;
    }
    kept_choices.fetch_add(kept, std::memory_order_relaxed);
  });
  if (status.failed()) return status.result();
  if (dots) std::fill(dots, dots + entries, A(0));

  // Write each output row exactly once, zero rows included (no separate zero fill).
  std::atomic<int64_t> owned_slots{0};
  parallel_for(0, slots, row_grain(M), [&](int64_t first, int64_t last) {
    int64_t owned = 0;
    for (int64_t slot = first; slot < last; ++slot) {
      T* dst = out + slot * M;
      int64_t at = __atomic_load_n(&owner[slot], __ATOMIC_RELAXED);
      if (at < 0) {
        zero_row(dst, M);
        continue;
      }
      ++owned;
      const T* row = src + (at % s.tokens) * M;
      const A w = choice_weight<T>(weights, at / s.tokens, at % s.tokens);
      combine_rows(kernels, dst, &row, weights.data ? &w : nullptr, 1, M);
      if (dots) dots[at] = kernels.dot(row, other + slot * M, M);
    }
    owned_slots.fetch_add(owned, std::memory_order_relaxed);
  });
  if (owned_slots.load() == kept_choices.load()) return Status{};

  // Several choices name the same slot (only possible with caller-made
  // locations).  Start again and sum their contributions in a fixed order so the
  // result does not depend on threads.
  parallel_for(0, slots, row_grain(M), [&](int64_t first, int64_t last) {
    for (int64_t slot = first; slot < last; ++slot) zero_row(out + slot * M, M);
  });
  if (dots) std::fill(dots, dots + entries, A(0));
  for (int64_t at = 0; at < entries; ++at) {
    int64_t slot = slot_of(s, at / s.tokens, at % s.tokens, status);
    if (slot < 0) continue;
    const T* row = src + (at % s.tokens) * M;
    add_scaled_row(out + slot * M, row, choice_weight<T>(weights, at / s.tokens, at % s.tokens), M);
    if (dots) dots[at] = kernels.dot(row, other + slot * M, M);
  }
  return Status{};
}

#define TUTEL_INSTANTIATE_DISPATCH(T)                                                           \
  template Status gather_slots<T>(const T*, int64_t, const SlotTable&, const ChoiceWeights&, \
                                  const T*, acc_t<T>*, T*);                                   \
  template Status scatter_slots<T>(const T*, int64_t, const SlotTable&, const ChoiceWeights&, \
                                   const T*, acc_t<T>*, T*);

TUTEL_INSTANTIATE_DISPATCH(float)
TUTEL_INSTANTIATE_DISPATCH(double)
TUTEL_INSTANTIATE_DISPATCH(bfloat16)
TUTEL_INSTANTIATE_DISPATCH(float16)

}  // namespace core
}  // namespace tutel
