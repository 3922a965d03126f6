// variants: TUTEL_DTYPE_FLOAT32 TUTEL_DTYPE_FLOAT64 TUTEL_DTYPE_FLOAT16 TUTEL_DTYPE_BFLOAT16
//
// Routed gated experts at decoding sizes (tutel::decode_experts,
// csrc/ops/cuda/decode_experts_cuda.cpp), in two launches:
//
//   decode_gate_up_*:  h[p] = unit(x[t] @ W_gate[e]^T + b_gate[e], x[t] @ W_up[e]^T + b_up[e])
//                      for every choice p = t k + j routed to expert e = expert_ids[t, j]
//                      ([P, I] in acc_t: the gated unit is applied in registers)
//   decode_down_*:     y[p] = h[p] @ W_down[e]^T + b_down[e] ([P, O] in acc_t), and
//                      out[t] = sum_j w[t, j] y[t k + j] over the token's kept choices, in
//                      choice order, written once per token
//
// A block serves one expert: the block of choice p goes on only if p is the first choice
// routed to its expert, and then computes that expert's rows for every choice routed to it
// (8 or 4 at a time, in choice order), so each expert's matrix rows are read once per call,
// however many tokens chose the expert.  An id outside [0, E) is a dropped choice.
//
// The weighted sum over k needs every expert of the token, which other blocks compute.  The
// down kernel's blocks count, per (token, tile of outputs), the choices done (an integer
// atomic), and the block that completes the count sums the token's y rows in choice order and
// writes the output: no float atomics, and the result does not depend on which block finishes
// last.  The gate/up kernel zeroes those counters (it runs first on the stream) and writes the
// zero output of tokens without a kept choice.
//
// Matrices in the F.linear layout ([E, 2I, H], [E, O, I]) give each warp one matrix row of
// the tile, read along its length with 16-byte loads (4 per lane in flight per row); transposed
// matrices ([E, H, 2I], [E, I, O]) give each lane a 16-byte column strip of the tile's 32 unit
// outputs or features, the block's matrix rows split over the warps and summed through shared
// memory in warp order.  Every sum runs in one fixed order.  Each kernel exists twice: *_vector
// with 16-byte loads (the rows' length a multiple of 16 bytes and aligned matrices), *_scalar
// with one element per load.
#include "expert_abi.h"
#include "tutel_device.cuh"
#include "decode_routing.cuh"

#ifndef TUTEL_HAS_DTYPE
#error "decode_experts.cu needs one -DTUTEL_DTYPE_<TYPE> option"
#endif

// Choices computed together by a block of the F.linear layout (registers per lane: 2 per
// choice) and of the transposed layout (2 * elements per 16 bytes per choice).
#define ROW_PASS 8
#define COLUMN_PASS 4
// Loads in flight per lane and matrix: 16-byte vectors along a row, or matrix rows.
#define UNROLL 4
#define WARPS (TUTEL_BLOCK_THREADS / 32)

// ---------------------------------------------------------- gated unit --
// Where unit i's gate and up values come from: the rows (F.linear layout) or columns
// (transposed) gate_index(i) of `gate` and up_index(i) of `up`, matrices of `width` such rows
// or columns per expert.
struct GateUp {
  const storage_t* gate;
  const storage_t* up;
  i64 width;
  bool separate;  // gates in a matrix of their own (then not interleaved)
  bool interleaved;
  i64 inter;
  __device__ i64 gate_index(i64 i) const { return interleaved ? 2 * i : i; }
  __device__ i64 up_index(i64 i) const { return interleaved ? 2 * i + 1 : (separate ? i : inter + i); }
};

__device__ __forceinline__ GateUp gate_up_of(const storage_t* up_weight, const storage_t* gate_weight, i64 inter,
                                             const TutelDecodeUnit& unit) {
  GateUp s;
  s.gate = gate_weight ? gate_weight : up_weight;
  s.up = up_weight;
  s.width = gate_weight ? inter : 2 * inter;
  s.separate = gate_weight != 0;
  s.interleaved = unit.interleaved != 0;
  s.inter = inter;
  return s;
}

// Stores h[p, i] for member m of the pass, from the sums of its gate and up products.
__device__ __forceinline__ void store_unit(acc_t* h, i64 inter, i64 pair, i64 i, acc_t g, acc_t u,
                                           const storage_t* up_bias, int e, const GateUp& s,
                                           const TutelDecodeUnit& unit) {
  if (up_bias) {
    g = g + to_acc(up_bias[e * s.width + s.gate_index(i)]);
    u = u + to_acc(up_bias[e * s.width + s.up_index(i)]);
  }
  h[pair * inter + i] = gated_value(g, u, unit);
}

// -------------------------------------------------- gate/up, F.linear --
// grid (P, I / TUTEL_DECODE_ROWS): warp w computes unit i = tile * 8 + w: its gate and up rows
// (H long) against the x rows of the pass's choices.
template <int VEC>
__device__ __forceinline__ void gate_up_rows(const storage_t* x, i64 x_stride, const TutelDecodeRouting& r,
                                             const storage_t* up_weight, const storage_t* gate_weight,
                                             const storage_t* up_bias, i64 hidden, i64 inter,
                                             const TutelDecodeUnit& unit, acc_t* h, int* counters,
                                             i64 counter_count, storage_t* out, i64 out_features) {
  typedef Pack<VEC> P;
  prepare_outputs(r, counters, counter_count, out, out_features);
  const int e = served_expert(r, blockIdx.x);
  if (e < 0) return;  // the same for every thread
  __shared__ i64 members[ROW_PASS];
  const unsigned lane = threadIdx.x & 31u;
  const i64 i = (i64)blockIdx.y * TUTEL_DECODE_ROWS + (threadIdx.x >> 5);
  const GateUp s = gate_up_of(up_weight, gate_weight, inter, unit);
  const i64 vectors = hidden / VEC;
  i64 from = blockIdx.x, next;
  for (int count; (count = collect_choices(r, e, from, ROW_PASS, members, &next)) > 0; from = next) {
    if (i >= inter) continue;  // a warp past the last unit (whole warps)
    const P* gate_row = reinterpret_cast<const P*>(s.gate + (e * s.width + s.gate_index(i)) * hidden);
    const P* up_row = reinterpret_cast<const P*>(s.up + (e * s.width + s.up_index(i)) * hidden);
    acc_t g[ROW_PASS], u[ROW_PASS];
    const P* x_rows[ROW_PASS];
#pragma unroll
    for (int m = 0; m < ROW_PASS; ++m) {
      g[m] = u[m] = acc_t(0);
      x_rows[m] = reinterpret_cast<const P*>(x + (m < count ? members[m] / r.k : 0) * x_stride);
    }
    for (i64 strip = 0; strip < vectors; strip += 32 * UNROLL) {
      P gw[UNROLL], uw[UNROLL];
#pragma unroll
      for (int n = 0; n < UNROLL; ++n) {
        const i64 v = strip + n * 32 + lane;
        if (v < vectors) {
          gw[n] = gate_row[v];
          uw[n] = up_row[v];
        }
      }
#pragma unroll
      for (int m = 0; m < ROW_PASS; ++m) {
        if (m >= count) break;
#pragma unroll
        for (int n = 0; n < UNROLL; ++n) {
          const i64 v = strip + n * 32 + lane;
          if (v >= vectors) break;
          const P xv = x_rows[m][v];
#pragma unroll
          for (int q = 0; q < VEC; ++q) {
            const acc_t xa = to_acc(xv.v[q]);
            g[m] = g[m] + to_acc(gw[n].v[q]) * xa;
            u[m] = u[m] + to_acc(uw[n].v[q]) * xa;
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < ROW_PASS; ++m) {
      if (m >= count) break;
      g[m] = group_sum(g[m], 32, 0xffffffffu);
      u[m] = group_sum(u[m], 32, 0xffffffffu);
      if (lane == 0) store_unit(h, inter, members[m], i, g[m], u[m], up_bias, e, s, unit);
    }
  }
}

// The lane layout of a transposed matrix tile: each lane a strip of VEC columns, 32 / VEC
// lanes across the tile's 32 columns, and VEC matrix rows per warp at a time.
template <int VEC>
struct ColumnLanes {
  static const int kLanesPerRow = 32 / VEC;
  static const int kRowsPerStep = WARPS * VEC;  // matrix rows the block reads at a time
  int column_lane, row;                         // strip within the tile; first matrix row
  __device__ ColumnLanes() {
    const int lane = threadIdx.x & 31;
    column_lane = lane % kLanesPerRow;
    row = (threadIdx.x >> 5) * VEC + lane / kLanesPerRow;
  }
};

// Sums `value` over the lanes of a warp that share a column strip (fixed order).
template <int VEC>
__device__ __forceinline__ acc_t sum_column_lanes(acc_t value) {
  for (int offset = ColumnLanes<VEC>::kLanesPerRow; offset < 32; offset <<= 1)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// ------------------------------------------------ gate/up, transposed --
// grid (P, I / TUTEL_DECODE_COLUMNS): the block computes units [tile * 32, tile * 32 + 32),
// each lane VEC of them from a strip of gate and up columns, over matrix rows (h of H) split
// across lanes and warps.
template <int VEC>
__device__ __forceinline__ void gate_up_columns(const storage_t* x, i64 x_stride, const TutelDecodeRouting& r,
                                                const storage_t* up_weight, const storage_t* gate_weight,
                                                const storage_t* up_bias, i64 hidden, i64 inter,
                                                const TutelDecodeUnit& unit, acc_t* h, int* counters,
                                                i64 counter_count, storage_t* out, i64 out_features) {
  typedef Pack<VEC> P;
  typedef ColumnLanes<VEC> L;
  prepare_outputs(r, counters, counter_count, out, out_features);
  const int e = served_expert(r, blockIdx.x);
  if (e < 0) return;  // the same for every thread
  __shared__ i64 members[COLUMN_PASS];
  __shared__ acc_t partial[WARPS][TUTEL_DECODE_COLUMNS][COLUMN_PASS][2];
  const L lanes;
  const GateUp s = gate_up_of(up_weight, gate_weight, inter, unit);
  const i64 first_unit = (i64)blockIdx.y * TUTEL_DECODE_COLUMNS;
  const i64 unit0 = first_unit + lanes.column_lane * VEC;  // this lane's first unit
  const bool active = unit0 < inter;  // all VEC units or none (the vector kernel needs I % VEC == 0)
  // Gate and up values of the lane's units: concatenated (or separate) gates A[q] and ups B[q];
  // interleaved, the 2 VEC columns of A then B alternate gate and up.
  const i64 column_a = s.interleaved ? 2 * unit0 : unit0;
  const i64 column_b = s.interleaved ? 2 * unit0 + VEC : s.up_index(unit0);
  const storage_t* matrix_a = s.gate + e * hidden * s.width + column_a;
  const storage_t* matrix_b = s.up + e * hidden * s.width + column_b;
  i64 from = blockIdx.x, next;
  for (int count; (count = collect_choices(r, e, from, COLUMN_PASS, members, &next)) > 0; from = next) {
    acc_t g[COLUMN_PASS][VEC], u[COLUMN_PASS][VEC];
#pragma unroll
    for (int m = 0; m < COLUMN_PASS; ++m)
#pragma unroll
      for (int q = 0; q < VEC; ++q) g[m][q] = u[m][q] = acc_t(0);
    for (i64 row0 = lanes.row; row0 < hidden; row0 += L::kRowsPerStep * UNROLL) {
      P a[UNROLL], b[UNROLL];
#pragma unroll
      for (int n = 0; n < UNROLL; ++n) {
        const i64 row = row0 + n * L::kRowsPerStep;
        if (active && row < hidden) {
          a[n] = *reinterpret_cast<const P*>(matrix_a + row * s.width);
          b[n] = *reinterpret_cast<const P*>(matrix_b + row * s.width);
        }
      }
#pragma unroll
      for (int m = 0; m < COLUMN_PASS; ++m) {
        if (m >= count) break;
        const storage_t* x_row = x + (members[m] / r.k) * x_stride;
#pragma unroll
        for (int n = 0; n < UNROLL; ++n) {
          const i64 row = row0 + n * L::kRowsPerStep;
          if (!active || row >= hidden) break;
          const acc_t xa = to_acc(x_row[row]);
#pragma unroll
          for (int q = 0; q < VEC; ++q) {
            acc_t gate, up;
            if (s.interleaved) {
              const int c = 2 * q;  // position among the 2 VEC columns of a and b
              gate = to_acc(c < VEC ? a[n].v[c] : b[n].v[c - VEC]);
              up = to_acc(c + 1 < VEC ? a[n].v[c + 1] : b[n].v[c + 1 - VEC]);
            } else {
              gate = to_acc(a[n].v[q]);
              up = to_acc(b[n].v[q]);
            }
            g[m][q] = g[m][q] + gate * xa;
            u[m][q] = u[m][q] + up * xa;
          }
        }
      }
    }
    // The warp's rows, then the warps in order.
#pragma unroll
    for (int m = 0; m < COLUMN_PASS; ++m) {
      if (m >= count) break;
#pragma unroll
      for (int q = 0; q < VEC; ++q) {
        g[m][q] = sum_column_lanes<VEC>(g[m][q]);
        u[m][q] = sum_column_lanes<VEC>(u[m][q]);
        if (lanes.row % VEC == 0) {  // the warp's first row of lanes
          partial[threadIdx.x >> 5][lanes.column_lane * VEC + q][m][0] = g[m][q];
          partial[threadIdx.x >> 5][lanes.column_lane * VEC + q][m][1] = u[m][q];
        }
      }
    }
    __syncthreads();
    if ((int)threadIdx.x < TUTEL_DECODE_COLUMNS * count) {
      const int m = threadIdx.x / TUTEL_DECODE_COLUMNS, c = threadIdx.x % TUTEL_DECODE_COLUMNS;
      const i64 i = first_unit + c;
      if (i < inter) {
        acc_t gs = partial[0][c][m][0], us = partial[0][c][m][1];
        for (int w = 1; w < WARPS; ++w) {
          gs = gs + partial[w][c][m][0];
          us = us + partial[w][c][m][1];
        }
        store_unit(h, inter, members[m], i, gs, us, up_bias, e, s, unit);
      }
    }
  }
}

// ----------------------------------------------------- down, F.linear --
// grid (P, O / TUTEL_DECODE_ROWS): warp w computes feature o = tile * 8 + w, its down row
// (I long) against the h rows of the pass's choices.
template <int VEC>
__device__ __forceinline__ void down_rows(const acc_t* h, const TutelDecodeRouting& r, const storage_t* down_weight,
                                          const storage_t* down_bias, i64 inter, i64 out_features, acc_t* y,
                                          int* counters, storage_t* out) {
  typedef Pack<VEC> P;
  typedef Lanes<acc_t, VEC> H;
  const int e = served_expert(r, blockIdx.x);
  if (e < 0) return;  // the same for every thread
  __shared__ i64 members[ROW_PASS];
  const unsigned lane = threadIdx.x & 31u;
  const i64 first = (i64)blockIdx.y * TUTEL_DECODE_ROWS;
  const i64 o = first + (threadIdx.x >> 5);
  const i64 vectors = inter / VEC;
  i64 from = blockIdx.x, next;
  for (int count; (count = collect_choices(r, e, from, ROW_PASS, members, &next)) > 0; from = next) {
    if (o < out_features) {
      const P* row = reinterpret_cast<const P*>(down_weight + (e * out_features + o) * inter);
      acc_t sums[ROW_PASS];
#pragma unroll
      for (int m = 0; m < ROW_PASS; ++m) sums[m] = acc_t(0);
      for (i64 strip = 0; strip < vectors; strip += 32 * UNROLL) {
        P wv[UNROLL];
#pragma unroll
        for (int n = 0; n < UNROLL; ++n) {
          const i64 v = strip + n * 32 + lane;
          if (v < vectors) wv[n] = row[v];
        }
#pragma unroll
        for (int m = 0; m < ROW_PASS; ++m) {
          if (m >= count) break;
          const H* h_row = reinterpret_cast<const H*>(h + members[m] * inter);
#pragma unroll
          for (int n = 0; n < UNROLL; ++n) {
            const i64 v = strip + n * 32 + lane;
            if (v >= vectors) break;
            const H hv = h_row[v];
#pragma unroll
            for (int q = 0; q < VEC; ++q) sums[m] = sums[m] + to_acc(wv[n].v[q]) * hv.v[q];
          }
        }
      }
#pragma unroll
      for (int m = 0; m < ROW_PASS; ++m) {
        if (m >= count) break;
        acc_t total = group_sum(sums[m], 32, 0xffffffffu);
        if (down_bias) total = total + to_acc(down_bias[e * out_features + o]);
        if (lane == 0) y[members[m] * out_features + o] = total;
      }
    }
    count_and_combine(r, members, count, y, out_features, first, TUTEL_DECODE_ROWS, counters, out);
  }
}

// --------------------------------------------------- down, transposed --
// grid (P, O / TUTEL_DECODE_COLUMNS): the block computes features [tile * 32, tile * 32 + 32),
// each lane VEC of them from a strip of columns, over matrix rows (i of I) split across lanes
// and warps.
template <int VEC>
__device__ __forceinline__ void down_columns(const acc_t* h, const TutelDecodeRouting& r,
                                             const storage_t* down_weight, const storage_t* down_bias, i64 inter,
                                             i64 out_features, acc_t* y, int* counters, storage_t* out) {
  typedef Pack<VEC> P;
  typedef ColumnLanes<VEC> L;
  const int e = served_expert(r, blockIdx.x);
  if (e < 0) return;  // the same for every thread
  __shared__ i64 members[COLUMN_PASS];
  __shared__ acc_t partial[WARPS][TUTEL_DECODE_COLUMNS][COLUMN_PASS];
  const L lanes;
  const i64 first = (i64)blockIdx.y * TUTEL_DECODE_COLUMNS;
  const i64 o0 = first + lanes.column_lane * VEC;
  const bool active = o0 < out_features;  // all VEC features or none
  const storage_t* matrix = down_weight + e * inter * out_features + o0;
  i64 from = blockIdx.x, next;
  for (int count; (count = collect_choices(r, e, from, COLUMN_PASS, members, &next)) > 0; from = next) {
    acc_t sums[COLUMN_PASS][VEC];
#pragma unroll
    for (int m = 0; m < COLUMN_PASS; ++m)
#pragma unroll
      for (int q = 0; q < VEC; ++q) sums[m][q] = acc_t(0);
    for (i64 row0 = lanes.row; row0 < inter; row0 += L::kRowsPerStep * UNROLL) {
      P wv[UNROLL];
#pragma unroll
      for (int n = 0; n < UNROLL; ++n) {
        const i64 row = row0 + n * L::kRowsPerStep;
        if (active && row < inter) wv[n] = *reinterpret_cast<const P*>(matrix + row * out_features);
      }
#pragma unroll
      for (int m = 0; m < COLUMN_PASS; ++m) {
        if (m >= count) break;
        const acc_t* h_row = h + members[m] * inter;
#pragma unroll
        for (int n = 0; n < UNROLL; ++n) {
          const i64 row = row0 + n * L::kRowsPerStep;
          if (!active || row >= inter) break;
          const acc_t hv = h_row[row];
#pragma unroll
          for (int q = 0; q < VEC; ++q) sums[m][q] = sums[m][q] + to_acc(wv[n].v[q]) * hv;
        }
      }
    }
#pragma unroll
    for (int m = 0; m < COLUMN_PASS; ++m) {
      if (m >= count) break;
#pragma unroll
      for (int q = 0; q < VEC; ++q) {
        sums[m][q] = sum_column_lanes<VEC>(sums[m][q]);
        if (lanes.row % VEC == 0) partial[threadIdx.x >> 5][lanes.column_lane * VEC + q][m] = sums[m][q];
      }
    }
    __syncthreads();
    if ((int)threadIdx.x < TUTEL_DECODE_COLUMNS * count) {
      const int m = threadIdx.x / TUTEL_DECODE_COLUMNS, c = threadIdx.x % TUTEL_DECODE_COLUMNS;
      const i64 o = first + c;
      if (o < out_features) {
        acc_t total = partial[0][c][m];
        for (int w = 1; w < WARPS; ++w) total = total + partial[w][c][m];
        if (down_bias) total = total + to_acc(down_bias[e * out_features + o]);
        y[members[m] * out_features + o] = total;
      }
    }
    count_and_combine(r, members, count, y, out_features, first, TUTEL_DECODE_COLUMNS, counters, out);
  }
}

// ------------------------------------------------------------- kernels --
#define TUTEL_GATE_UP_PARAMS                                                                       \
  const storage_t *x, i64 x_stride, TutelDecodeRouting routing, const storage_t *up_weight,          \
      const storage_t *gate_weight, const storage_t *up_bias, i64 hidden, i64 inter,               \
      TutelDecodeUnit unit, acc_t *h, int *counters, i64 counter_count, storage_t *out,            \
      i64 out_features
#define TUTEL_GATE_UP_ARGS                                                                         \
  x, x_stride, routing, up_weight, gate_weight, up_bias, hidden, inter, unit, h, counters,         \
      counter_count, out, out_features
#define TUTEL_DOWN_PARAMS                                                                          \
  const acc_t *h, TutelDecodeRouting routing, const storage_t *down_weight,                        \
      const storage_t *down_bias, i64 inter, i64 out_features, acc_t *y, int *counters,            \
      storage_t *out
#define TUTEL_DOWN_ARGS h, routing, down_weight, down_bias, inter, out_features, y, counters, out

// NAME_vector (16-byte loads) and NAME_scalar (one element per load) running IMPL.
#define TUTEL_DECODE_KERNELS(NAME, IMPL, PARAMS, ARGS)                                             \
  extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS) NAME##_vector(PARAMS) {       \
    IMPL<TUTEL_VECTOR_WIDTH>(ARGS);                                                                \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS) NAME##_scalar(PARAMS) {       \
    IMPL<1>(ARGS);                                                                                 \
  }

TUTEL_DECODE_KERNELS(decode_gate_up_rows, gate_up_rows, TUTEL_GATE_UP_PARAMS, TUTEL_GATE_UP_ARGS)
TUTEL_DECODE_KERNELS(decode_gate_up_columns, gate_up_columns, TUTEL_GATE_UP_PARAMS, TUTEL_GATE_UP_ARGS)
TUTEL_DECODE_KERNELS(decode_down_rows, down_rows, TUTEL_DOWN_PARAMS, TUTEL_DOWN_ARGS)
TUTEL_DECODE_KERNELS(decode_down_columns, down_columns, TUTEL_DOWN_PARAMS, TUTEL_DOWN_ARGS)
