#include "dispatch.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "parallel.h"
#include "row_ops.h"

namespace tutel {
namespace core {
namespace {

// Rows per parallel chunk: enough elements per chunk to amortise scheduling.
inline int64_t row_grain(int64_t M) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, M)); }

// Reads (choice j, token t) of the table; returns the slot row, -1 when the
// choice was dropped (location >= capacity), or reports bad data and returns -2.
inline int64_t slot_of(const SlotTable& s, int64_t j, int64_t t, StatusCollector& status) {
  int64_t at = j * s.tokens + t;
  int32_t e = s.indices[at];
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

}  // namespace

template <class T>
Status gather_slots(const T* rows, int64_t M, const SlotTable& s, const acc_t<T>* weights,
                    const T* other, acc_t<T>* dots, T* out) {
  using A = acc_t<T>;
  StatusCollector status;
  parallel_for(0, s.tokens, row_grain(M), [&](int64_t first, int64_t last) {
    // Accumulation row for 16-bit types (and for k > 1 sums of float data we
    // accumulate in the output row itself).
    std::vector<A> acc(is_native_v<T> ? 0 : M);
    for (int64_t t = first; t < last; ++t) {
      T* dst = out + t * M;
      int kept = 0;
      for (int64_t j = 0; j < s.k; ++j) {
        int64_t slot = slot_of(s, j, t, status);
        if (dots) dots[j * s.tokens + t] = A(0);
        if (slot < 0) continue;
        const T* row = rows + slot * M;
        A w = weights ? weights[j * s.tokens + t] : A(1);
        if constexpr (is_native_v<T>) {
          if (kept == 0)
            scale_row(dst, row, w, M);
          else
            add_scaled_into<T>(dst, row, w, M);
        } else {
          if (s.k == 1) {
            scale_row(dst, row, w, M);
          } else if (kept == 0) {
            scale_into<T>(acc.data(), row, w, M);
          } else {
            add_scaled_into<T>(acc.data(), row, w, M);
          }
        }
        if (dots) dots[j * s.tokens + t] = dot_row(row, other + t * M, M);
        ++kept;
      }
      if (kept == 0) {
        zero_row(dst, M);
      } else if constexpr (!is_native_v<T>) {
        if (s.k > 1) store_row(dst, acc.data(), M);
      }
    }
  });
  return status.result();
}

template <class T>
Status scatter_slots(const T* src, int64_t M, const SlotTable& s, const acc_t<T>* weights,
                     const T* other, acc_t<T>* dots, T* out) {
  using A = acc_t<T>;
  const int64_t entries = s.k * s.tokens;
  const int64_t slots = s.experts * s.capacity;
  StatusCollector status;

  // owner[slot] = j * tokens + t of the choice that claimed the slot, or -1.
  std::vector<int64_t> owner(slots, -1);
  std::atomic<bool> shared_slot{false};
  parallel_for(0, entries, 16384, [&](int64_t first, int64_t last) {
    for (int64_t at = first; at < last; ++at) {
      int64_t slot = slot_of(s, at / s.tokens, at % s.tokens, status);
      if (slot < 0) continue;
      int64_t unclaimed = -1;
      if (!__atomic_compare_exchange_n(&owner[slot], &unclaimed, at, false, __ATOMIC_RELAXED,
                                       __ATOMIC_RELAXED))
        shared_slot.store(true, std::memory_order_relaxed);
    }
  });
  if (status.failed()) return status.result();
  if (dots) std::fill(dots, dots + entries, A(0));

  if (!shared_slot.load()) {
    // Every slot has at most one writer: write each output row exactly once.
    parallel_for(0, slots, row_grain(M), [&](int64_t first, int64_t last) {
      for (int64_t slot = first; slot < last; ++slot) {
        T* dst = out + slot * M;
        int64_t at = owner[slot];
        if (at < 0) {
          zero_row(dst, M);
          continue;
        }
        const T* row = src + (at % s.tokens) * M;
        scale_row(dst, row, weights ? weights[at] : A(1), M);
        if (dots) dots[at] = dot_row(other + slot * M, row, M);
      }
    });
    return Status{};
  }

  // Several choices name the same slot (only possible with caller-made
  // locations).  Sum their contributions in a fixed order so the result does
  // not depend on threads.
  parallel_for(0, slots, row_grain(M), [&](int64_t first, int64_t last) {
    for (int64_t slot = first; slot < last; ++slot) zero_row(out + slot * M, M);
  });
  for (int64_t at = 0; at < entries; ++at) {
    int64_t slot = slot_of(s, at / s.tokens, at % s.tokens, status);
    if (slot < 0) continue;
    const T* row = src + (at % s.tokens) * M;
    add_scaled_row(out + slot * M, row, weights ? weights[at] : A(1), M);
    if (dots) dots[at] = dot_row(other + slot * M, row, M);
  }
  return Status{};
}

#define TUTEL_INSTANTIATE_DISPATCH(T)                                                           \
  template Status gather_slots<T>(const T*, int64_t, const SlotTable&, const acc_t<T>*,       \
                                  const T*, acc_t<T>*, T*);                                   \
  template Status scatter_slots<T>(const T*, int64_t, const SlotTable&, const acc_t<T>*,      \
                                   const T*, acc_t<T>*, T*);

TUTEL_INSTANTIATE_DISPATCH(float)
TUTEL_INSTANTIATE_DISPATCH(double)
TUTEL_INSTANTIATE_DISPATCH(bfloat16)
TUTEL_INSTANTIATE_DISPATCH(float16)

}  // namespace core
}  // namespace tutel
