// variants: TUTEL_DTYPE_FLOAT32 TUTEL_DTYPE_FLOAT16 TUTEL_DTYPE_BFLOAT16
//
// Routed experts with quantized weights at decoding sizes (tutel::decode_quantized_experts,
// csrc/ops/cuda/decode_quantized_experts_cuda.cpp), in two launches:
//
//   quantized_gate_up_*:  h[p] = unit(x[t] @ Wgu[e]^T + bgu[e]) for every choice p = t k + j
//                         routed to expert e = expert_ids[t, j] ([P, I] float32, each value
//                         rounded to the storage type)
//   quantized_down_*:     y[p] = h[p] @ Wd[e]^T + bd[e] ([P, O] float32), and out[t] =
//                         sum_j w[t, j] y[t k + j] over the token's kept choices, in choice
//                         order, written once per token
//
// The weights stay in their format (expert_abi.h's TutelQuantMatrix) and are decoded in
// registers as they stream in: E2M1 and E4M3 codes by bit placement (quant_codes.cuh), times
// their scale (an E8M0 per 32 elements, an E4M3 per 16, or fp8_block's float32 per block), the sums in
// float32, and nvfp4's per-matrix scale applied to each finished dot product, as the CPU
// operator does.  The matrices are [E, N, K] (F.linear): each warp takes one matrix row (for the
// gated unit: the unit's gate row and up row) and its lanes read the row in chunks of 16 bytes
// (the *_vector kernels: 32 fp4 or 16 fp8 elements) or of one byte (*_scalar: rows of another
// length, misaligned codes or activations, fp8 blocks not a multiple of 16 wide).  Each chunk is
// decoded once per pass of up to TUTEL_DECODE_MAX_PASS choices of its expert.
//
// Blocks, passes and the combine are decode_experts.cu's (decode_routing.cuh): the block of
// choice p goes on only if p is the first choice routed to its expert, so each routed expert's
// codes are read once per call; the down kernel's blocks count each (token, tile) done and the
// block completing a token writes its weighted sum.  The gate/up kernel zeroes those counters
// and the output of tokens without a kept choice.  Every sum runs in one fixed order.
#include "expert_abi.h"
#include "tutel_device.cuh"
#include "quant_codes.cuh"
#include "decode_routing.cuh"

#ifndef TUTEL_HAS_DTYPE
#error "quantized_decode.cu needs one -DTUTEL_DTYPE_<TYPE> option"
#endif

// Chunks in flight per lane and matrix row.
#define QUANT_UNROLL 2

// ---------------------------------------------------------------- rows --
// CHUNK bytes of codes, read in one load.
template <int CHUNK>
struct alignas(CHUNK) CodeChunk {
  unsigned char b[CHUNK];
};

// What a format's matrix row looks like to the kernels.
template <int FORMAT>
struct QuantRow {
  static const bool kFp4 = FORMAT != TUTEL_QUANT_FP8_BLOCK;
  static const int kPerByte = kFp4 ? 2 : 1;
  const unsigned char* codes;   // the row's codes
  const unsigned char* bytes;   // the row's E8M0 / E4M3 scales (fp4)
  const float* floats;          // the row's block row of float32 scales (fp8_block)
  i64 block_cols;               // fp8_block's block width
  i64 code_bytes;               // bytes of codes in the row

  __device__ QuantRow(const TutelQuantMatrix& m, int e, i64 row) {
    code_bytes = kFp4 ? m.cols / 2 : m.cols;
    codes = m.codes + ((i64)e * m.rows + row) * code_bytes;
    block_cols = m.block_cols;
    bytes = 0;
    floats = 0;
    if (FORMAT == TUTEL_QUANT_FP8_BLOCK) {
      const i64 block_rows = (m.rows + m.block_rows - 1) / m.block_rows;
      const i64 blocks_per_row = (m.cols + m.block_cols - 1) / m.block_cols;
      floats = (const float*)m.scales + ((i64)e * block_rows + row / m.block_rows) * blocks_per_row;
    } else {
      const i64 per_row = m.cols / (FORMAT == TUTEL_QUANT_MXFP4 ? 32 : 16);
      bytes = (const unsigned char*)m.scales + ((i64)e * m.rows + row) * per_row;
    }
  }

  // The CHUNK bytes of chunk c (elements [c * CHUNK * kPerByte, ...)), decoded and scaled.  A
  // chunk lies within one scale block, except nvfp4's 32 elements: two blocks of 16.  (fp8_block
  // takes 16-byte chunks only for blocks a multiple of 16 wide: the plan's choice.)
  template <int CHUNK>
  __device__ __forceinline__ void decode(const CodeChunk<CHUNK>& chunk, i64 c, float* w) const {
    const i64 k0 = c * CHUNK * kPerByte;
    if constexpr (FORMAT == TUTEL_QUANT_FP8_BLOCK) {
      const float scale = floats[k0 / block_cols];
#pragma unroll
      for (int q = 0; q < CHUNK; ++q) w[q] = e4m3_value(chunk.b[q]) * scale;
    } else {
      float scale[2];
      if (FORMAT == TUTEL_QUANT_MXFP4) {
        scale[0] = scale[1] = e8m0_value(bytes[k0 >> 5]);
      } else {
        scale[0] = e4m3_value(bytes[k0 >> 4]);
        scale[1] = CHUNK * 2 > 16 ? e4m3_value(bytes[(k0 >> 4) + 1]) : scale[0];
      }
#pragma unroll
      for (int q = 0; q < CHUNK; ++q) {
        const unsigned byte = chunk.b[q];
        const float s = scale[(2 * q) >> 4];  // both nibbles of a byte lie in one block of 16
        w[2 * q] = e2m1_value(byte & 15u) * s;  // the even element: the low nibble
        w[2 * q + 1] = e2m1_value(byte >> 4) * s;
      }
    }
  }
};

// An activation (storage_t) or an h value (float32) in the accumulation type.
__device__ __forceinline__ acc_t as_acc(float v) { return v; }
#if !defined(TUTEL_DTYPE_FLOAT32)
__device__ __forceinline__ acc_t as_acc(storage_t v) { return to_acc(v); }
#endif

// sum + sum_q w[q] * v[k0 + q] over the N elements of a chunk, v a row of activations (storage_t)
// or of h (float32); with VECTOR, read 16 bytes at a time (TUTEL_VECTOR_WIDTH activations or 4 h
// values; v aligned, k0 a multiple of 16 bytes).
template <int N, bool VECTOR, class T>
__device__ __forceinline__ acc_t chunk_dot(acc_t sum, const float* w, const T* v, i64 k0) {
  if constexpr (VECTOR) {
    const int kWidth = (int)(16 / sizeof(T));
    typedef Lanes<T, kWidth> L;
    const L* vectors = reinterpret_cast<const L*>(v + k0);
#pragma unroll
    for (int n = 0; n < N / kWidth; ++n) {
      const L lanes = vectors[n];
#pragma unroll
      for (int q = 0; q < kWidth; ++q) sum = sum + w[n * kWidth + q] * as_acc(lanes.v[q]);
    }
  } else {
#pragma unroll
    for (int q = 0; q < N; ++q) sum = sum + w[q] * as_acc(v[k0 + q]);
  }
  return sum;
}

// --------------------------------------------------------------- units --
__device__ __forceinline__ acc_t unit_value(acc_t g, acc_t u, const TutelDecodeUnit& unit, int activation) {
  switch (activation) {
    case TUTEL_UNIT_GELU: return 0.5f * u * (1.0f + erff(u * 0.70710678118654752f));
    case TUTEL_UNIT_GELU_TANH: return 0.5f * u * (1.0f + tanhf(0.79788456080286536f * (u + 0.044715f * u * u * u)));
    case TUTEL_UNIT_RELU: return u > 0.0f || u != u ? u : 0.0f;  // NaN stays NaN
    default: return gated_value(g, u, unit);
  }
}

// ------------------------------------------------------------- gate/up --
// grid (P, I / TUTEL_DECODE_ROWS): warp w computes unit i = tile * 8 + w from its gate and up
// rows (gated; concatenated: rows i and I + i, interleaved: 2i and 2i + 1) or its up row i,
// against the x rows of the pass's choices.
template <int FORMAT, int CHUNK>
__device__ __forceinline__ void gate_up(const storage_t* x, i64 x_stride, const TutelDecodeRouting& r,
                                        const TutelQuantMatrix& gate_up_matrix, const float* bias, i64 inter,
                                        const TutelDecodeUnit& unit, int activation, acc_t* h, int* counters,
                                        i64 counter_count, storage_t* out, i64 out_features) {
  typedef QuantRow<FORMAT> R;
  const int kElements = CHUNK * R::kPerByte;
  const bool kVector = CHUNK == 16;
  prepare_outputs(r, counters, counter_count, out, out_features);
  const int e = served_expert(r, blockIdx.x);
  if (e < 0) return;  // the same for every thread
  __shared__ i64 members[TUTEL_DECODE_MAX_PASS];
  const unsigned lane = threadIdx.x & 31u;
  const i64 i = (i64)blockIdx.y * TUTEL_DECODE_ROWS + (threadIdx.x >> 5);
  const bool gated = activation == TUTEL_UNIT_GATED;
  // The unit's up row (and gate row); rows past the last unit are never read.
  const i64 unit_index = i < inter ? i : 0;
  const i64 gate_index = unit.interleaved ? 2 * unit_index : unit_index;
  const i64 up_index = gated ? (unit.interleaved ? 2 * unit_index + 1 : inter + unit_index) : unit_index;
  const R gate_row(gate_up_matrix, e, gate_index), up_row(gate_up_matrix, e, up_index);
  const CodeChunk<CHUNK>* gate_chunks = reinterpret_cast<const CodeChunk<CHUNK>*>(gate_row.codes);
  const CodeChunk<CHUNK>* up_chunks = reinterpret_cast<const CodeChunk<CHUNK>*>(up_row.codes);
  const i64 chunks = up_row.code_bytes / CHUNK;
  i64 from = blockIdx.x, next;
  for (int count; (count = collect_choices(r, e, from, TUTEL_DECODE_MAX_PASS, members, &next)) > 0; from = next) {
    if (i >= inter) continue;  // a warp past the last unit (whole warps)
    acc_t g[TUTEL_DECODE_MAX_PASS], u[TUTEL_DECODE_MAX_PASS];
    const storage_t* x_rows[TUTEL_DECODE_MAX_PASS];
#pragma unroll
    for (int m = 0; m < TUTEL_DECODE_MAX_PASS; ++m) {
      g[m] = u[m] = acc_t(0);
      x_rows[m] = x + (m < count ? members[m] / r.k : 0) * x_stride;
    }
    for (i64 strip = 0; strip < chunks; strip += 32 * QUANT_UNROLL) {
      CodeChunk<CHUNK> gc[QUANT_UNROLL], uc[QUANT_UNROLL];
#pragma unroll
      for (int n = 0; n < QUANT_UNROLL; ++n) {
        const i64 c = strip + n * 32 + lane;
        if (c < chunks) {
          uc[n] = up_chunks[c];
          if (gated) gc[n] = gate_chunks[c];
        }
      }
#pragma unroll
      for (int n = 0; n < QUANT_UNROLL; ++n) {
        const i64 c = strip + n * 32 + lane;
        if (c >= chunks) break;
        float w[kElements];
        up_row.decode(uc[n], c, w);
#pragma unroll
        for (int m = 0; m < TUTEL_DECODE_MAX_PASS; ++m) {
          if (m >= count) break;
          u[m] = chunk_dot<kElements, kVector>(u[m], w, x_rows[m], c * kElements);
        }
        if (gated) {
          gate_row.decode(gc[n], c, w);
#pragma unroll
          for (int m = 0; m < TUTEL_DECODE_MAX_PASS; ++m) {
            if (m >= count) break;
            g[m] = chunk_dot<kElements, kVector>(g[m], w, x_rows[m], c * kElements);
          }
        }
      }
    }
    const float global = gate_up_matrix.global ? gate_up_matrix.global[e] : 1.0f;
#pragma unroll
    for (int m = 0; m < TUTEL_DECODE_MAX_PASS; ++m) {
      if (m >= count) break;
      acc_t gs = group_sum(g[m], 32, 0xffffffffu), us = group_sum(u[m], 32, 0xffffffffu);
      if (FORMAT == TUTEL_QUANT_NVFP4) {
        gs = gs * global;
        us = us * global;
      }
      if (bias) {
        gs = gs + bias[e * gate_up_matrix.rows + gate_index];
        us = us + bias[e * gate_up_matrix.rows + up_index];
      }
      // rounded to the storage type, as the model's experts keep h (and the CPU operator does)
      if (lane == 0) h[members[m] * inter + i] = to_acc(from_acc(unit_value(gs, us, unit, activation)));
    }
  }
}

// ---------------------------------------------------------------- down --
// grid (P, O / TUTEL_DECODE_ROWS): warp w computes feature o = tile * 8 + w, its down row
// (I long) against the h rows of the pass's choices, then the tile's outputs are combined.
template <int FORMAT, int CHUNK>
__device__ __forceinline__ void down(const acc_t* h, const TutelDecodeRouting& r, const TutelQuantMatrix& down_matrix,
                                     const float* bias, i64 inter, i64 out_features, acc_t* y, int* counters,
                                     storage_t* out) {
  typedef QuantRow<FORMAT> R;
  const int kElements = CHUNK * R::kPerByte;
  const bool kVector = CHUNK == 16;
  const int e = served_expert(r, blockIdx.x);
  if (e < 0) return;  // the same for every thread
  __shared__ i64 members[TUTEL_DECODE_MAX_PASS];
  const unsigned lane = threadIdx.x & 31u;
  const i64 first = (i64)blockIdx.y * TUTEL_DECODE_ROWS;
  const i64 o = first + (threadIdx.x >> 5);
  const R row(down_matrix, e, o < out_features ? o : 0);
  const CodeChunk<CHUNK>* row_chunks = reinterpret_cast<const CodeChunk<CHUNK>*>(row.codes);
  const i64 chunks = row.code_bytes / CHUNK;
  i64 from = blockIdx.x, next;
  for (int count; (count = collect_choices(r, e, from, TUTEL_DECODE_MAX_PASS, members, &next)) > 0; from = next) {
    if (o < out_features) {
      acc_t sums[TUTEL_DECODE_MAX_PASS];
#pragma unroll
      for (int m = 0; m < TUTEL_DECODE_MAX_PASS; ++m) sums[m] = acc_t(0);
      for (i64 strip = 0; strip < chunks; strip += 32 * QUANT_UNROLL) {
        CodeChunk<CHUNK> wc[QUANT_UNROLL];
#pragma unroll
        for (int n = 0; n < QUANT_UNROLL; ++n) {
          const i64 c = strip + n * 32 + lane;
          if (c < chunks) wc[n] = row_chunks[c];
        }
#pragma unroll
        for (int n = 0; n < QUANT_UNROLL; ++n) {
          const i64 c = strip + n * 32 + lane;
          if (c >= chunks) break;
          float w[kElements];
          row.decode(wc[n], c, w);
#pragma unroll
          for (int m = 0; m < TUTEL_DECODE_MAX_PASS; ++m) {
            if (m >= count) break;
            sums[m] = chunk_dot<kElements, kVector>(sums[m], w, h + members[m] * inter, c * kElements);
          }
        }
      }
      const float global = down_matrix.global ? down_matrix.global[e] : 1.0f;
#pragma unroll
      for (int m = 0; m < TUTEL_DECODE_MAX_PASS; ++m) {
        if (m >= count) break;
        acc_t total = group_sum(sums[m], 32, 0xffffffffu);
        if (FORMAT == TUTEL_QUANT_NVFP4) total = total * global;
        if (bias) total = total + bias[e * out_features + o];
        if (lane == 0) y[members[m] * out_features + o] = total;
      }
    }
    count_and_combine(r, members, count, y, out_features, first, TUTEL_DECODE_ROWS, counters, out);
  }
}

// ------------------------------------------------------------- kernels --
#define TUTEL_QUANT_GATE_UP_PARAMS                                                                 \
  const storage_t *x, i64 x_stride, TutelDecodeRouting routing, TutelQuantMatrix gate_up_matrix,   \
      const float *gate_up_bias, i64 inter, TutelDecodeUnit unit, int activation, float *h,        \
      int *counters, i64 counter_count, storage_t *out, i64 out_features
#define TUTEL_QUANT_GATE_UP_ARGS                                                                   \
  x, x_stride, routing, gate_up_matrix, gate_up_bias, inter, unit, activation, h, counters,        \
      counter_count, out, out_features
#define TUTEL_QUANT_DOWN_PARAMS                                                                    \
  const float *h, TutelDecodeRouting routing, TutelQuantMatrix down_matrix, const float *down_bias, \
      i64 inter, i64 out_features, float *y, int *counters, storage_t *out
#define TUTEL_QUANT_DOWN_ARGS h, routing, down_matrix, down_bias, inter, out_features, y, counters, out

// NAME_FORMAT_vector (16-byte chunks) and NAME_FORMAT_scalar (one byte at a time) running IMPL.
#define TUTEL_QUANT_KERNELS(NAME, SUFFIX, FORMAT, IMPL, PARAMS, ARGS)                               \
  extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS) NAME##_##SUFFIX##_vector(PARAMS) { \
    IMPL<FORMAT, 16>(ARGS);                                                                        \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS) NAME##_##SUFFIX##_scalar(PARAMS) { \
    IMPL<FORMAT, 1>(ARGS);                                                                         \
  }

#define TUTEL_QUANT_FORMAT_KERNELS(SUFFIX, FORMAT)                                                 \
  TUTEL_QUANT_KERNELS(quantized_gate_up, SUFFIX, FORMAT, gate_up, TUTEL_QUANT_GATE_UP_PARAMS,       \
                      TUTEL_QUANT_GATE_UP_ARGS)                                                    \
  TUTEL_QUANT_KERNELS(quantized_down, SUFFIX, FORMAT, down, TUTEL_QUANT_DOWN_PARAMS, TUTEL_QUANT_DOWN_ARGS)

TUTEL_QUANT_FORMAT_KERNELS(mxfp4, TUTEL_QUANT_MXFP4)
TUTEL_QUANT_FORMAT_KERNELS(nvfp4, TUTEL_QUANT_NVFP4)
TUTEL_QUANT_FORMAT_KERNELS(fp8_block, TUTEL_QUANT_FP8_BLOCK)
