// variants: TUTEL_DTYPE_FLOAT32 TUTEL_DTYPE_FLOAT64 TUTEL_DTYPE_FLOAT16 TUTEL_DTYPE_BFLOAT16
//
// Row movements between token rows and expert slots, with the semantics of
// csrc/core/dispatch.h:
//   gather_slots:  out[t]    = sum_j w[j,t] * rows[slot(j,t)]   (decode, encode backward)
//   scatter_slots: out[slot] = w[j,t] * src[t]                  (encode, decode backward)
// optionally fused with dots[j,t] = < the slot's row of rows/other, token row t >.
// slot(j,t) = e * capacity + l for e = indices[j,t] (0 when indices is null:
// the grouped layout), l = locations[j,t]; a choice with l >= capacity was
// dropped.  A bad entry (e outside [0, experts), l < 0) is reported through the
// error sink and treated as dropped.  The weights are a TutelChoiceWeights
// table (kernel_abi.h): any floating dtype and strides, converted in registers.
//
// Each kernel exists twice: *_vector moves 16 bytes per access (model_dim a
// multiple of 16 / sizeof(element) and 16-byte aligned rows), *_scalar one
// element per access for everything else.
#include "tutel_device.cuh"

#ifndef TUTEL_HAS_DTYPE
#error "dispatch.cu needs one -DTUTEL_DTYPE_<TYPE> option"
#endif

// Vectors each lane keeps in flight per row.
#define TUTEL_UNROLL 4

// The slot row of entry `at`, or -1 when the choice was dropped or is bad.
__device__ __forceinline__ i64 slot_of(const int* indices, const int* locations, i64 at,
                                       i64 experts, i64 capacity, bool report,
                                       TutelErrorSink errors, int op, i64 tokens) {
  const int e = indices ? indices[at] : 0;
  const int l = locations[at];
  if (e < 0 || e >= experts) {
    if (report) report_data_error(errors, op, tokens, at, TUTEL_ERROR_EXPERT_INDEX, e);
    return -1;
  }
  if (l < 0) {
    if (report) report_data_error(errors, op, tokens, at, TUTEL_ERROR_NEGATIVE_LOCATION, l);
    return -1;
  }
  return l < capacity ? (i64)e * capacity + l : -1;
}

// Defines the kernels NAME_vector (16-byte accesses) and NAME_scalar (one
// element per access), both running IMPL<elements per access>(ARGS).
#define TUTEL_ROW_KERNELS(NAME, IMPL, PARAMS, ARGS)                                              \
  extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS) NAME##_vector(PARAMS) {      \
    IMPL<TUTEL_VECTOR_WIDTH>(ARGS);                                                               \
  }                                                                                               \
  extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS) NAME##_scalar(PARAMS) {      \
    IMPL<1>(ARGS);                                                                                \
  }

template <int N>
__device__ __forceinline__ Pack<N> zero_pack() {
  Pack<N> p;
#pragma unroll
  for (int q = 0; q < N; ++q) p.v[q] = storage_t(0);
  return p;
}

// ---------------------------------------------------------------- gather --
// A group of 2^group_log2 lanes per token; each lane walks the row in strips
// of TUTEL_UNROLL vectors, accumulating every kept choice of the token in
// registers in choice order (first choice: w*x, then acc + w*x), as the CPU does.
template <int VEC>
__device__ __forceinline__ void gather_rows(const storage_t* rows, const int* indices,
                                            const int* locations, const TutelChoiceWeights& weights,
                                            const storage_t* other, acc_t* dots, storage_t* out,
                                            i64 tokens, i64 k, i64 experts, i64 capacity,
                                            i64 model_dim, int group_log2, TutelErrorSink errors) {
  typedef Pack<VEC> P;
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const i64 t = (i64)blockIdx.x * (blockDim.x >> group_log2) + (threadIdx.x >> group_log2);
  if (t >= tokens) return;  // whole groups leave together
  const unsigned mask = group_lane_mask(group);
  const i64 vectors = model_dim / VEC;
  const P* slots = reinterpret_cast<const P*>(rows);
  const P* other_row = other ? reinterpret_cast<const P*>(other) + t * vectors : 0;
  P* out_row = reinterpret_cast<P*>(out) + t * vectors;

  // strip == 0 runs even when model_dim == 0, so entries are still checked.
  for (i64 strip = 0; strip == 0 || strip < vectors; strip += (i64)group * TUTEL_UNROLL) {
    acc_t acc[TUTEL_UNROLL][VEC];
    P theirs[TUTEL_UNROLL];
    if (dots) {
#pragma unroll
      for (int u = 0; u < TUTEL_UNROLL; ++u) {
        const i64 v = strip + (i64)u * group + lane;
        if (v < vectors) theirs[u] = other_row[v];
      }
    }
    bool kept_any = false;
    for (i64 j = 0; j < k; ++j) {
      const i64 at = j * tokens + t;
      const bool first_visit = strip == 0 && lane == 0;
      const i64 slot = slot_of(indices, locations, at, experts, capacity, first_visit, errors,
                               TUTEL_OP_GATHER_SLOTS, tokens);
      if (slot < 0) {
        if (dots && first_visit) dots[at] = acc_t(0);
        continue;
      }
      const acc_t w = choice_weight(weights, j, t);
      const P* slot_row = slots + slot * vectors;
      acc_t partial = acc_t(0);
#pragma unroll
      for (int u = 0; u < TUTEL_UNROLL; ++u) {
        const i64 v = strip + (i64)u * group + lane;
        if (v < vectors) {
          const P r = slot_row[v];
#pragma unroll
          for (int q = 0; q < VEC; ++q) {
            const acc_t x = to_acc(r.v[q]);
            acc[u][q] = kept_any ? acc[u][q] + w * x : w * x;
            if (dots) partial += x * to_acc(theirs[u].v[q]);
          }
        }
      }
      if (dots) {
        partial = group_sum(partial, group, mask);
        if (lane == 0) dots[at] = strip == 0 ? partial : dots[at] + partial;
      }
      kept_any = true;
    }
#pragma unroll
    for (int u = 0; u < TUTEL_UNROLL; ++u) {
      const i64 v = strip + (i64)u * group + lane;
      if (v < vectors) {
        P o = zero_pack<VEC>();
        if (kept_any) {
#pragma unroll
          for (int q = 0; q < VEC; ++q) o.v[q] = from_acc(acc[u][q]);
        }
        out_row[v] = o;
      }
    }
  }
}

#define TUTEL_GATHER_PARAMS                                                                       \
  const storage_t *rows, const int *indices, const int *locations, TutelChoiceWeights weights,    \
      const storage_t *other, acc_t *dots, storage_t *out, i64 tokens, i64 k, i64 experts,        \
      i64 capacity, i64 model_dim, int group_log2, TutelErrorSink errors
#define TUTEL_GATHER_ARGS                                                                         \
  rows, indices, locations, weights, other, dots, out, tokens, k, experts, capacity, model_dim,   \
      group_log2, errors

TUTEL_ROW_KERNELS(gather_slots, gather_rows, TUTEL_GATHER_PARAMS, TUTEL_GATHER_ARGS)

// --------------------------------------------------------------- scatter --
// Slot-centric, so every output row is written exactly once and nothing is
// zeroed twice.  Two launches, scatter_claim_slots then scatter_slots_*, the
// first finding who holds each slot in slot_table:
//
// * With indices: slot_table has 2 * slots + 1 ints, zeroed by the host:
//     [0, slots):          entries - (the smallest entry claiming the slot), 0 if none
//     [slots, 2 * slots):  how many entries claim the slot
//     [2 * slots]:         1 when some slot is claimed more than once.
// * Without (indices null, the grouped layout): the caller guarantees that no
//   two kept choices name one slot, so slot_table is an owner per slot of
//   expert 0 ([capacity] ints, not initialised: no memset), set by a plain
//   store, and the row kernel trusts an owner only when it points back
//   (0 <= owner < entries and locations[owner] == slot).  Whatever the table
//   held before, that test finds the one entry naming the slot, or none, so
//   the result is the CPU's bit for bit.  (Should two kept entries name one
//   slot after all, one of them, which is unspecified, is written; the others
//   add nothing and get dot 0.)

// One thread per entry.  Dropped and bad entries get their dot product (0) here
// (grouped: every entry, as one that lost its slot gets no other), the slots'
// holders from the row kernel.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    scatter_claim_slots(const int* indices, const int* locations, i64 tokens, i64 k, i64 experts,
                        i64 capacity, int* slot_table, acc_t* dots, TutelErrorSink errors) {
  const i64 entries = k * tokens;
  const i64 at = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (at >= entries) return;
  const i64 slot = slot_of(indices, locations, at, experts, capacity, true, errors,
                           TUTEL_OP_SCATTER_SLOTS, tokens);
  if (dots && (slot < 0 || !indices)) dots[at] = acc_t(0);
  if (slot < 0) return;
  if (!indices) {
    slot_table[slot] = (int)at;
    return;
  }
  const i64 slots = experts * capacity;
  atomicMax(slot_table + slot, (int)(entries - at));
  if (atomicAdd(slot_table + slots + slot, 1) == 1) slot_table[2 * slots] = 1;
}

// Slot `slot` written by its group of lanes: entry `at`'s weighted token row, or
// zeros when at < 0 (nobody holds the slot).
template <int VEC>
__device__ __forceinline__ void write_slot(const storage_t* src, const TutelChoiceWeights& weights,
                                           const storage_t* other, acc_t* dots, storage_t* out,
                                           i64 tokens, i64 vectors, int group, int lane,
                                           unsigned mask, i64 slot, i64 at) {
  typedef Pack<VEC> P;
  P* dst = reinterpret_cast<P*>(out) + slot * vectors;
  if (at < 0) {
#pragma unroll 4
    for (i64 v = lane; v < vectors; v += group) dst[v] = zero_pack<VEC>();
    return;
  }
  const i64 j = at / tokens, t = at - j * tokens;
  const P* row = reinterpret_cast<const P*>(src) + t * vectors;
  const P* theirs = other ? reinterpret_cast<const P*>(other) + slot * vectors : 0;
  const acc_t w = choice_weight(weights, j, t);
  acc_t partial = acc_t(0);
#pragma unroll 4
  for (i64 v = lane; v < vectors; v += group) {
    const P r = row[v];
    const P slot_other = dots ? theirs[v] : zero_pack<VEC>();
    P o;
#pragma unroll
    for (int q = 0; q < VEC; ++q) {
      const acc_t x = to_acc(r.v[q]);
      o.v[q] = from_acc(w * x);
      if (dots) partial += to_acc(slot_other.v[q]) * x;
    }
    dst[v] = o;
  }
  if (dots) {
    partial = group_sum(partial, group, mask);
    if (lane == 0) dots[at] = partial;
  }
}

// Slots claimed by several entries (only possible with caller-made locations):
// their rows are summed in entry order, (choice, token), like the CPU kernel,
// one element per thread, rounding after every addition.  The participating
// blocks each own the shared slots with slot % shared_blocks == blockIdx.x and
// scan all entries once, in order, picking their own.
__device__ void sum_shared_slots(const storage_t* src, const int* indices, const int* locations,
                                 const TutelChoiceWeights& weights, const storage_t* other,
                                 acc_t* dots, storage_t* out, i64 tokens, i64 k, i64 experts,
                                 i64 capacity, i64 model_dim, const int* slot_table,
                                 i64 shared_blocks) {
  __shared__ int matches[TUTEL_BLOCK_THREADS];
  __shared__ int warp_matches[TUTEL_BLOCK_THREADS / 32];
  const i64 entries = k * tokens;
  const i64 slots = experts * capacity;
  const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const TutelErrorSink no_report = {0, 0, 0};
  for (i64 tile = 0; tile < entries; tile += blockDim.x) {
    const i64 at = tile + threadIdx.x;
    bool mine = false;
    if (at < entries) {
      const i64 slot = slot_of(indices, locations, at, experts, capacity, false, no_report, 0, tokens);
      mine = slot >= 0 && slot_table[slots + slot] > 1 && slot % shared_blocks == blockIdx.x;
    }
    // Compact this tile's matches into `matches`, keeping entry order.
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_matches[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (unsigned w = 0; w < (blockDim.x >> 5); ++w) {
      if (w < warp) before += warp_matches[w];
      total += warp_matches[w];
    }
    if (mine) matches[before + __popc(ballot & ((1u << lane) - 1u))] = (int)at;
    __syncthreads();
    for (int i = 0; i < total; ++i) {
      const i64 entry = matches[i];
      const i64 j = entry / tokens, t = entry - j * tokens;
      const i64 slot = slot_of(indices, locations, entry, experts, capacity, false, no_report, 0, tokens);
      const bool first = entries - slot_table[slot] == entry;
      const acc_t w = choice_weight(weights, j, t);
      const storage_t* row = src + t * model_dim;
      storage_t* dst = out + slot * model_dim;
      acc_t partial = acc_t(0);
      for (i64 m = threadIdx.x; m < model_dim; m += blockDim.x) {
        const acc_t x = to_acc(row[m]);
        const acc_t before_add = first ? acc_t(0) : to_acc(dst[m]);
        dst[m] = from_acc(before_add + w * x);
        if (dots) partial += to_acc(other[slot * model_dim + m]) * x;
      }
      if (dots) {
        partial = block_sum(partial);
        if (threadIdx.x == 0) dots[entry] = partial;
      }
    }
    __syncthreads();  // `matches` is rewritten by the next tile
  }
}

template <int VEC>
__device__ __forceinline__ void scatter_rows(const storage_t* src, const int* indices,
                                             const int* locations, const TutelChoiceWeights& weights,
                                             const storage_t* other, acc_t* dots, storage_t* out,
                                             i64 tokens, i64 k, i64 experts, i64 capacity,
                                             i64 model_dim, int group_log2, const int* slot_table,
                                             i64 shared_blocks) {
  const int group = 1 << group_log2;
  const int lane = threadIdx.x & (group - 1);
  const i64 slots = experts * capacity;
  const i64 slot = (i64)blockIdx.x * (blockDim.x >> group_log2) + (threadIdx.x >> group_log2);
  if (!indices) {  // grouped: only expert 0's slots can be held, by an owner that points back
    if (slot >= slots) return;  // whole groups leave together
    i64 at = -1;
    if (slot < capacity) {
      const i64 owner = slot_table[slot];
      if (owner >= 0 && owner < k * tokens && (i64)locations[owner] == slot) at = owner;
    }
    write_slot<VEC>(src, weights, other, dots, out, tokens, model_dim / VEC, group, lane,
                    group_lane_mask(group), slot, at);
    return;
  }
  if (slot < slots) {
    const int claims = slot_table[slots + slot];
    if (claims <= 1)
      write_slot<VEC>(src, weights, other, dots, out, tokens, model_dim / VEC, group, lane,
                      group_lane_mask(group), slot, claims == 0 ? -1 : k * tokens - slot_table[slot]);
  }
  // The same value for the whole block, so all of it takes part or none.
  if ((i64)blockIdx.x < shared_blocks && slot_table[2 * slots] != 0)
    sum_shared_slots(src, indices, locations, weights, other, dots, out, tokens, k, experts,
                     capacity, model_dim, slot_table, shared_blocks);
}

#define TUTEL_SCATTER_PARAMS                                                                      \
  const storage_t *src, const int *indices, const int *locations, TutelChoiceWeights weights,     \
      const storage_t *other, acc_t *dots, storage_t *out, i64 tokens, i64 k, i64 experts,        \
      i64 capacity, i64 model_dim, int group_log2, const int *slot_table, i64 shared_blocks
#define TUTEL_SCATTER_ARGS                                                                        \
  src, indices, locations, weights, other, dots, out, tokens, k, experts, capacity, model_dim,    \
      group_log2, slot_table, shared_blocks

TUTEL_ROW_KERNELS(scatter_slots, scatter_rows, TUTEL_SCATTER_PARAMS, TUTEL_SCATTER_ARGS)
