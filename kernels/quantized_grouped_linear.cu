// variants: TUTEL_DTYPE_FLOAT32 TUTEL_DTYPE_FLOAT16 TUTEL_DTYPE_BFLOAT16
//
// Rows grouped by expert times a quantized expert stack (tutel::quantized_grouped_linear,
// csrc/ops/cuda/quantized_grouped_linear_cuda.cpp), in one launch without host synchronisation:
//
//   quantized_grouped_linear_<format>:  out[r] = rows[r] @ W[e]^T + bias[e] for expert e's rows r
//                                       (grouped_rows.cuh's schedule: the ends are read here);
//                                       zeros for the rows past the last end
//
// W [E, N, K] stays in its format (expert_abi.h's TutelQuantMatrix): each block decodes the
// TUTEL_QUANT_TILE_COLS x TUTEL_QUANT_TILE_DEPTH tile of codes it needs into shared memory, as
// the 16-bit values of the codes themselves (every E2M1 and E4M3 value is exact in bfloat16 and in
// float16), and multiplies them on the tensor cores (tutel_device.cuh's m16n8k16 products) with
// the rows' tile, also in shared memory: bfloat16 rows with the bfloat16 product, float16 rows
// with the float16 one, and float32 rows as three bfloat16 parts whose sum is the value (so the
// products keep float32's precision).  The scales are applied in float32 to the partial sums:
// each 16-wide step of the reduction lies in one scale block (mxfp4's 32, nvfp4's 16, fp8_block's
// blocks a multiple of 16 wide), so its product starts from zero and joins the sum times its
// column's scale; fp8_block with blocks of another width splits a step at the block boundaries
// (one product per block it touches, each with the other blocks' codes left out).  nvfp4's
// per-matrix scale multiplies the finished sum, then the float32 bias is added and the result
// rounded once to the rows' dtype.  Every sum runs in one fixed order, so results do not vary
// from run to run.
//
// W8A8 (fp8_block with activation_group g > 0, DeepSeek-V3's dynamic activations): the rows are
// quantized in the same launch, per row and group of g columns (the last group may be partial):
// scale = amax / 448 in float32, codes = E4M3 rounding (quant_codes.cuh's e4m3_rounded, ties to
// even) of value / max(scale, 1e-12).  When the reduction enters a new group, the four threads of
// each row of the tile find the row's amax over the group's columns (two shuffles join their
// parts); the rows' tile is staged as the codes' values (exact in bfloat16 and float16, so float32
// rows need one part, not three), each row's scale of each step kept in shared memory, and each
// step's product is multiplied by a_scale[row, group] * w_scale[column, block] in float32.  Each
// 16-wide step must lie in one group: g a multiple of 16, or g >= K (one group a row), which the
// operator checks.
//
// Block layout: 256 threads, 8 warps as 4 x 2, warp (wm, wn) computing rows 16 wm .. 16 wm + 15
// and columns 32 wn .. 32 wn + 31 of the 64 x 64 tile (four 16 x 8 products per step).  Shared
// tiles hold pairs of 16-bit values as 32-bit words, rows padded to 36 words: the fragment reads
// of a warp (word 36 g + t) fall in 32 distinct banks.
#include "expert_abi.h"
#include "tutel_device.cuh"
#include "quant_codes.cuh"
#include "grouped_rows.cuh"

#ifndef TUTEL_HAS_DTYPE
#error "quantized_grouped_linear.cu needs one -DTUTEL_DTYPE_<TYPE> option"
#endif

#define QGL_ROWS TUTEL_QUANT_TILE_ROWS
#define QGL_COLS TUTEL_QUANT_TILE_COLS
#define QGL_DEPTH TUTEL_QUANT_TILE_DEPTH
#define QGL_WORDS (QGL_DEPTH / 2 + 4)  // 32-bit words per shared row: the tile's 32 and 4 of padding
#define QGL_STEPS (QGL_DEPTH / 16)     // m16n8k16 steps per tile of the reduction

// The rows' parts: float32 rows are split into three bfloat16 numbers, 16-bit rows are themselves.
#if defined(TUTEL_DTYPE_FLOAT32)
#define QGL_PARTS 3
#else
#define QGL_PARTS 1
#endif

// The product of the variant's 16-bit type.
__device__ __forceinline__ void tile_mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                         const float (&c)[4]) {
#if defined(TUTEL_DTYPE_FLOAT16)
  mma_m16n8k16_f16(d, a, b, c);
#else
  mma_m16n8k16_bf16(d, a, b, c);
#endif
}

// A code's value (exact float32) as the 16-bit number the products read: float16 for float16 rows,
// bfloat16 otherwise.  Both are exact for every E2M1 and E4M3 value; NaN stays NaN.
__device__ __forceinline__ unsigned code_bits(float value) {
#if defined(TUTEL_DTYPE_FLOAT16)
  return from_acc(value);
#else
  return __float_as_uint(value) >> 16;
#endif
}

// Two 16-bit numbers as one word, the first (the lower-numbered element) in the low half.
__device__ __forceinline__ unsigned pair_word(unsigned low, unsigned high) { return (low & 0xffffu) | (high << 16); }

// x = parts[0] + parts[1] + parts[2] as bfloat16 bits: each part the top 16 bits of what the
// previous ones leave (both subtractions are exact).  Exact unless |x| < 2^-100 or so, where the
// last part falls below bfloat16's subnormals; infinities and NaN go whole into the first part.
__device__ __forceinline__ void split_bf16(float x, unsigned (&parts)[3]) {
  const unsigned bits = __float_as_uint(x);
  if ((bits & 0x7f800000u) == 0x7f800000u) {
    parts[0] = (bits & 0x7fffffu) ? 0x7fc0u : bits >> 16;
    parts[1] = parts[2] = 0u;
    return;
  }
  const float rest = x - __uint_as_float(bits & 0xffff0000u);
  const unsigned rest_bits = __float_as_uint(rest);
  const float last = rest - __uint_as_float(rest_bits & 0xffff0000u);
  parts[0] = bits >> 16;
  parts[1] = rest_bits >> 16;
  parts[2] = __float_as_uint(last) >> 16;
}

// Byte runs read in one load.
struct alignas(16) Bytes16 {
  unsigned char b[16];
};
struct alignas(8) Bytes8 {
  unsigned char b[8];
};

// The scale of column n (of the matrix) for the scale block holding reduction index k.
template <int FORMAT>
__device__ __forceinline__ float column_scale(const TutelQuantMatrix& w, i64 e, i64 n, i64 k) {
  if (FORMAT == TUTEL_QUANT_FP8_BLOCK) {
    const i64 block_row_count = (w.rows + w.block_rows - 1) / w.block_rows;
    const i64 per_row = (w.cols + w.block_cols - 1) / w.block_cols;
    return ((const float*)w.scales)[(e * block_row_count + n / w.block_rows) * per_row + k / w.block_cols];
  }
  const unsigned char* bytes = (const unsigned char*)w.scales;
  if (FORMAT == TUTEL_QUANT_MXFP4) return e8m0_value(bytes[(e * w.rows + n) * (w.cols / 32) + k / 32]);
  return e4m3_value(bytes[(e * w.rows + n) * (w.cols / 16) + k / 16]);
}

// The larger of two magnitudes, NaN winning (as PyTorch's max reductions propagate it).
__device__ __forceinline__ float nan_max(float candidate, float current) {
  return candidate > current || candidate != candidate ? candidate : current;
}

// W8A8: the largest magnitude of each row of the tile over columns [begin, end), found by the four
// threads of the row (thread t: row t / 4, every fourth element or vector of the columns), joined
// by two shuffles among them; 0 for the rows outside the tile.  Every thread of the block calls
// it and gets its row's amax.  `vector`: 16-byte loads (begin is 0 or a multiple of 16 elements).
__device__ __forceinline__ float row_group_amax(const storage_t* rows, i64 row_stride, const RowTile& tile, i64 begin,
                                                i64 end, bool vector) {
  const int r = threadIdx.x >> 2, q = threadIdx.x & 3;
  float amax = 0.0f;
  if (r < tile.count) {
    const storage_t* src = rows + (tile.begin + r) * row_stride;
    i64 rest = begin;
    if (vector) {
      typedef Pack<TUTEL_VECTOR_WIDTH> P;
      const i64 whole = begin + (end - begin) / TUTEL_VECTOR_WIDTH * TUTEL_VECTOR_WIDTH;
      for (i64 at = begin + q * TUTEL_VECTOR_WIDTH; at < whole; at += 4 * TUTEL_VECTOR_WIDTH) {
        const P p = *reinterpret_cast<const P*>(src + at);
#pragma unroll
        for (int i = 0; i < TUTEL_VECTOR_WIDTH; ++i) amax = nan_max(fabsf(to_acc(p.v[i])), amax);
      }
      rest = whole;
    }
    for (i64 at = rest + q; at < end; at += 4) amax = nan_max(fabsf(to_acc(src[at])), amax);
  }
  amax = nan_max(__shfl_xor_sync(0xffffffffu, amax, 1), amax);
  return nan_max(__shfl_xor_sync(0xffffffffu, amax, 2), amax);
}

// Stages the rows' tile [row tile, k0 .. k0 + QGL_DEPTH): thread t the 16 values of row t / 4
// starting at 16 (t % 4), zeros outside the expert's rows and past K.  W8A8 (divisor > 0, the
// row's max(scale, 1e-12) for this step): the E4M3 codes of value / divisor, in part 0 only.
__device__ __forceinline__ void stage_rows(const storage_t* rows, i64 row_stride, const RowTile& tile, i64 k0,
                                           i64 depth, bool vector, float divisor,
                                           unsigned (*a_tile)[QGL_ROWS][QGL_WORDS]) {
  const int r = threadIdx.x >> 2, seg = (threadIdx.x & 3) * 16;
  storage_t v[16];
  const i64 k = k0 + seg;
  const bool inside = r < tile.count;
  const storage_t* src = rows + (tile.begin + r) * row_stride + k;
  if (inside && vector && k + 16 <= depth) {
    typedef Pack<TUTEL_VECTOR_WIDTH> P;
#pragma unroll
    for (int q = 0; q < 16 / TUTEL_VECTOR_WIDTH; ++q) {
      const P p = reinterpret_cast<const P*>(src)[q];
#pragma unroll
      for (int i = 0; i < TUTEL_VECTOR_WIDTH; ++i) v[q * TUTEL_VECTOR_WIDTH + i] = p.v[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = inside && k + i < depth ? src[i] : storage_t(0);
  }
  if (divisor > 0.0f || divisor != divisor) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      a_tile[0][r][seg / 2 + i] = pair_word(code_bits(e4m3_rounded(to_acc(v[2 * i]) / divisor)),
                                            code_bits(e4m3_rounded(to_acc(v[2 * i + 1]) / divisor)));
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#if defined(TUTEL_DTYPE_FLOAT32)
    unsigned low[3], high[3];
    split_bf16(v[2 * i], low);
    split_bf16(v[2 * i + 1], high);
#pragma unroll
    for (int p = 0; p < QGL_PARTS; ++p) a_tile[p][r][seg / 2 + i] = pair_word(low[p], high[p]);
#else
    a_tile[0][r][seg / 2 + i] = pair_word(v[2 * i], v[2 * i + 1]);
#endif
  }
}

// Stages the codes' tile: columns n0 .. n0 + QGL_COLS of expert e's matrix, reduction indices
// k0 .. k0 + QGL_DEPTH, as the codes' 16-bit values; thread t the 16 codes of column t / 4
// starting at 16 (t % 4), zeros past N and K.
template <int FORMAT>
__device__ __forceinline__ void stage_codes(const TutelQuantMatrix& w, i64 e, i64 n0, i64 k0, bool vector,
                                            unsigned (*b_tile)[QGL_WORDS]) {
  const int c = threadIdx.x >> 2, seg = (threadIdx.x & 3) * 16;
  const i64 n = n0 + c, k = k0 + seg;
  unsigned words[8];
  if (n >= w.rows || k >= w.cols) {
#pragma unroll
    for (int i = 0; i < 8; ++i) words[i] = 0u;
  } else if (FORMAT == TUTEL_QUANT_FP8_BLOCK) {
    const unsigned char* src = w.codes + (e * w.rows + n) * w.cols + k;
    unsigned char bytes[16];
    if (vector && k + 16 <= w.cols) {
      const Bytes16 chunk = *reinterpret_cast<const Bytes16*>(src);
#pragma unroll
      for (int i = 0; i < 16; ++i) bytes[i] = chunk.b[i];
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) bytes[i] = k + i < w.cols ? src[i] : (unsigned char)0;  // E4M3 0: zero
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
      words[i] = pair_word(code_bits(e4m3_value(bytes[2 * i])), code_bits(e4m3_value(bytes[2 * i + 1])));
  } else {
    // K is a multiple of 16 for both fp4 formats: the 8 bytes lie in the row.
    const unsigned char* src = w.codes + (e * w.rows + n) * (w.cols / 2) + k / 2;
    unsigned char bytes[8];
    if (vector) {
      const Bytes8 chunk = *reinterpret_cast<const Bytes8*>(src);
#pragma unroll
      for (int i = 0; i < 8; ++i) bytes[i] = chunk.b[i];
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) bytes[i] = src[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned byte = bytes[i];
      words[i] = pair_word(code_bits(e2m1_value(byte & 15u)), code_bits(e2m1_value(byte >> 4)));  // even: low nibble
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) b_tile[c][seg / 2 + i] = words[i];
}

// grid (rows / QGL_ROWS + experts + 1, ceil(N / QGL_COLS)); see the file comment.  rows: [n, K]
// with row stride row_stride; ends [experts] int32; bias float32 [experts, N] or 0; out [n, N];
// activation_group: W8A8's group width g (fp8_block only; 0: the rows as they are).
template <int FORMAT>
__device__ __forceinline__ void quantized_grouped_linear(const storage_t* rows, i64 row_stride, const int* ends,
                                                         i64 row_count, i64 experts, const TutelQuantMatrix& w,
                                                         const float* bias, storage_t* out, i64 activation_group) {
  __shared__ unsigned a_tile[QGL_PARTS][QGL_ROWS][QGL_WORDS];
  __shared__ unsigned b_tile[QGL_COLS][QGL_WORDS];
  __shared__ float scales[QGL_STEPS][QGL_COLS];      // each step's scale of each column
  __shared__ float row_scales[QGL_STEPS][QGL_ROWS];  // W8A8: each step's activation scale of each row
  const RowTile tile = locate_row_tile(ends, row_count, experts, blockIdx.x, QGL_ROWS);
  if (tile.count == 0) return;  // the same for every thread
  const i64 outputs = w.rows, depth = w.cols, n0 = (i64)blockIdx.y * QGL_COLS;
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const int g = (int)(lane >> 2), t = (int)(lane & 3u);
  const int row0 = 16 * (int)(warp & 3u), col0 = 32 * (int)(warp >> 2);
  // fp8_block blocks whose width is not a multiple of 16: steps that cross block boundaries.
  const bool split_steps = FORMAT == TUTEL_QUANT_FP8_BLOCK && w.block_cols % 16 != 0;
  const bool quantize = FORMAT == TUTEL_QUANT_FP8_BLOCK && activation_group > 0;
  const int parts = quantize ? 1 : QGL_PARTS;  // W8A8's codes are exact in one 16-bit part
  float acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;

  if (tile.expert >= 0) {
    const i64 e = tile.expert;
    const bool rows_vector = ((unsigned long long)rows % 16 == 0) && (row_stride * (i64)sizeof(storage_t)) % 16 == 0;
    const unsigned long long codes_at = (unsigned long long)w.codes;
    const bool codes_vector = FORMAT == TUTEL_QUANT_FP8_BLOCK ? codes_at % 16 == 0 && depth % 16 == 0
                                                              : codes_at % 8 == 0 && (depth / 2) % 8 == 0;
    i64 scaled_group = -1;   // W8A8: the group whose scale group_scale is (of this thread's row)
    float group_scale = 0.0f;
    for (i64 k0 = 0; k0 < depth; k0 += QGL_DEPTH) {
      float divisor = 0.0f;
      if (quantize) {  // the scales of this tile's steps: a group's amax found once, as it is entered
        const int own_step = threadIdx.x & 3;
        float own_scale = 0.0f;
        for (int s = 0; s < QGL_STEPS; ++s) {
          const i64 k = k0 + 16 * s;
          if (k >= depth) break;  // the same for every thread
          const i64 group = k / activation_group;
          if (group != scaled_group) {  // the same for every thread
            const i64 begin = group * activation_group;
            const i64 end = depth - begin > activation_group ? begin + activation_group : depth;
            group_scale = row_group_amax(rows, row_stride, tile, begin, end, rows_vector) / 448.0f;
            scaled_group = group;
          }
          if (s == own_step) {
            own_scale = group_scale;
            row_scales[s][threadIdx.x >> 2] = group_scale;
          }
        }
        divisor = own_scale < 1e-12f ? 1e-12f : own_scale;  // (NaN stays NaN)
      }
      stage_rows(rows, row_stride, tile, k0, depth, rows_vector, divisor, a_tile);
      stage_codes<FORMAT>(w, e, n0, k0, codes_vector, b_tile);
      if (!split_steps) {
        const int s = threadIdx.x / QGL_COLS, c = threadIdx.x % QGL_COLS;
        const i64 k = k0 + 16 * s, n = n0 + c;
        scales[s][c] = k < depth && n < outputs ? column_scale<FORMAT>(w, e, n, k) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int s = 0; s < QGL_STEPS; ++s) {
        const i64 k = k0 + 16 * s;
        if (k >= depth) break;  // the same for every thread
        unsigned a[QGL_PARTS][4];
        float row_scale[2] = {1.0f, 1.0f};  // a_scale of rows g and g + 8 (W8A8)
        if (quantize) {
          row_scale[0] = row_scales[s][row0 + g];
          row_scale[1] = row_scales[s][row0 + g + 8];
        }
#pragma unroll
        for (int p = 0; p < QGL_PARTS; ++p) {
          if (p >= parts) break;
          a[p][0] = a_tile[p][row0 + g][8 * s + t];
          a[p][1] = a_tile[p][row0 + g + 8][8 * s + t];
          a[p][2] = a_tile[p][row0 + g][8 * s + t + 4];
          a[p][3] = a_tile[p][row0 + g + 8][8 * s + t + 4];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int col = col0 + 8 * j;
          const unsigned codes[2] = {b_tile[col + g][8 * s + t], b_tile[col + g][8 * s + t + 4]};
          // The columns of this thread's sums: col + 2t and col + 2t + 1.
          const i64 blocks_first = split_steps ? k / w.block_cols : 0;
          const i64 last_k = k + 15 < depth ? k + 15 : depth - 1;
          const i64 blocks_last = split_steps ? last_k / w.block_cols : 0;
          for (i64 block = blocks_first; block <= blocks_last; ++block) {
            unsigned b[2] = {codes[0], codes[1]};
            if (split_steps) {  // the codes of other scale blocks left out
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const i64 kk = k + 2 * t + 8 * h;
                if (kk / w.block_cols != block) b[h] &= 0xffff0000u;
                if ((kk + 1) / w.block_cols != block) b[h] &= 0x0000ffffu;
              }
            }
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int p = QGL_PARTS - 1; p >= 0; --p)  // smallest part first
              if (p < parts) tile_mma(part, a[p], b, part);
            float scale[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int c = col + 2 * t + h;
              if (split_steps) {
                scale[h] = n0 + c < outputs ? column_scale<FORMAT>(w, e, n0 + c, block * w.block_cols) : 0.0f;
              } else {
                scale[h] = scales[s][c];
              }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][i] = fmaf(part[i], row_scale[i >> 1] * scale[i & 1], acc[j][i]);
          }
        }
      }
      __syncthreads();  // the tiles are read before the next step overwrites them
    }
  }
  const float global = FORMAT == TUTEL_QUANT_NVFP4 && tile.expert >= 0 ? w.global[tile.expert] : 1.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = row0 + g + 8 * (i >> 1);
      const i64 n = n0 + col0 + 8 * j + 2 * t + (i & 1);
      if (r >= tile.count || n >= outputs) continue;
      storage_t value = storage_t(0);
      if (tile.expert >= 0) {
        float v = acc[j][i];
        if (FORMAT == TUTEL_QUANT_NVFP4) v = v * global;
        if (bias) v = v + bias[tile.expert * outputs + n];
        value = from_acc(v);
      }
      out[(tile.begin + r) * outputs + n] = value;
    }
}

#define TUTEL_QGL_KERNEL(SUFFIX, FORMAT)                                                               \
  extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS) quantized_grouped_linear_##SUFFIX(  \
      const storage_t* rows, i64 row_stride, const int* ends, i64 row_count, i64 experts,              \
      TutelQuantMatrix matrix, const float* bias, storage_t* out, i64 activation_group) {              \
    quantized_grouped_linear<FORMAT>(rows, row_stride, ends, row_count, experts, matrix, bias, out,    \
                                     activation_group);                                                \
  }

TUTEL_QGL_KERNEL(mxfp4, TUTEL_QUANT_MXFP4)
TUTEL_QGL_KERNEL(nvfp4, TUTEL_QUANT_NVFP4)
TUTEL_QGL_KERNEL(fp8_block, TUTEL_QUANT_FP8_BLOCK)
