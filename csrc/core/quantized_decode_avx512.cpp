// AVX-512 kernels of decode_quantized_experts (quantized_decode.h): the AVX2 kernels' work
// (quantized_decode_avx2.cpp) on sixteen lanes, with the decoding that the wider instruction set
// makes cheaper (quant_codes_avx512.h), up to eight vectors at a time.
//
// The ends of fp8_block's blocks are read with masked loads, codes and vectors alike.
//
// The split kernels take the vectors in the split layout (kQuantSplitRound), so that the even and
// the odd elements of 32 fp4 codes multiply them as the two permutes of the nibbles leave them,
// without the two permutes that would put them back in element order.
//
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its own (maybe-)uninitialized
// warnings flag at every inlined use; this file holds nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <algorithm>
#include <cstring>
#include <limits>

#include "avx2_lanes.h"
#include "quant_codes_avx512.h"
#include "quant_codes_avx512_bf16.h"
#include "quantized_decode.h"

namespace tutel {
namespace core {

#ifdef TUTEL_HAVE_AVX2_KERNELS

namespace {

using avx512_codes::e2m1_32;
using avx512_codes::e2m1_32_split;
using avx512_codes::e2m1_table;
using avx512_codes::e4m3_32;
using avx512_codes::e2m1_bf16_table;
using avx512_codes::E4m3Bf16Tables;
using avx512_codes::e4m3_bf16_bytes;
using avx512_codes::e4m3_bf16_tables;

// Independent sums per (row, vector) pair: two when one pair alone would chain every FMA.
constexpr int sums_per_pair(int pairs) { return pairs >= 2 ? 1 : 2; }

// Asks for the line `ahead` bytes past p (nothing for ahead 0) into the level-2 cache, not the
// first level: these kernels decode fast enough to keep many rows' lines in flight, which the first
// level's few miss buffers held up (the loads then stalled on them; benchmarks/quantized_experts.py
// measures the one-token step).  The AVX2 kernels, held back by their float FMAs, ask for level 1.
inline void prefetch_codes(const uint8_t* p, int64_t ahead) {
  if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
}

template <int R, int V>
struct Sums {
  static constexpr int S = sums_per_pair(R * V);
  __m512 acc[R][V][S];

  TUTEL_AVX512_QUANT void clear() {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v)
        for (int s = 0; s < S; ++s) acc[r][v][s] = _mm512_setzero_ps();
  }
  // acc[r][v][slot] += w[r] * vectors[v][k .. k + 15]
  TUTEL_AVX512_QUANT void add(const __m512 (&w)[R], const float* const* vectors, int64_t k, int slot) {
    for (int v = 0; v < V; ++v) {
      const __m512 x = _mm512_loadu_ps(vectors[v] + k);
      for (int r = 0; r < R; ++r) acc[r][v][slot] = _mm512_fmadd_ps(w[r], x, acc[r][v][slot]);
    }
  }
  // The same for the first `count` (< 16) elements only: the others of the vectors are not read.
  TUTEL_AVX512_QUANT void add_first(const __m512 (&w)[R], const float* const* vectors, int64_t k, int count,
                                    int slot) {
    const __mmask16 kept = __mmask16((1u << count) - 1);
    for (int v = 0; v < V; ++v) {
      const __m512 x = _mm512_maskz_loadu_ps(kept, vectors[v] + k);
      for (int r = 0; r < R; ++r) acc[r][v][slot] = _mm512_fmadd_ps(w[r], x, acc[r][v][slot]);
    }
  }
  TUTEL_AVX512_QUANT void store(float* out, int out_stride, float scale) const {
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < V; ++v) {
        __m512 total = acc[r][v][0];
        for (int s = 1; s < S; ++s) total = _mm512_add_ps(total, acc[r][v][s]);
        out[r * out_stride + v] = _mm512_reduce_add_ps(total) * scale;
      }
    }
  }
};

// Split: the vectors come in the split layout (kQuantSplitRound): each round of 32 elements holds
// its even elements and then its odd ones, the order the codes' low and high nibbles decode in.
template <int R, int V, bool Split>
TUTEL_AVX512_QUANT void mxfp4_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows,
                                   const float* const* vectors, float* out, int out_stride) {
  const float* e8m0 = byte_tables().e8m0;
  const __m512 values = e2m1_table();
  const uint8_t* codes[R];
  const uint8_t* scales[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = m.row_codes(expert, rows[r]);
    scales[r] = m.row_byte_scales(expert, rows[r]);
    prefetch_row_scales(m, scales[r]);
  }
  Sums<R, V> sums;
  sums.clear();
  const int64_t blocks = m.cols / kMxfp4Block;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 w[R][2];
    for (int r = 0; r < R; ++r) {
      if ((b & 3) == 0) prefetch_codes(codes[r] + b * (kMxfp4Block / 2), m.prefetch_bytes);
      const uint8_t* p = codes[r] + b * (kMxfp4Block / 2);
      const __m512 scaled = _mm512_mul_ps(values, _mm512_set1_ps(e8m0[scales[r][b]]));
      if (Split) {
        e2m1_32_split(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), scaled, w[r]);
      } else {
        e2m1_32(p, scaled, w[r]);
      }
    }
    for (int half = 0; half < 2; ++half) {
      __m512 step[R];
      for (int r = 0; r < R; ++r) step[r] = w[r][half];
      sums.add(step, vectors, b * kMxfp4Block + 16 * half, half % Sums<R, V>::S);
    }
  }
  sums.store(out, out_stride, 1.0f);
}

template <int R, int V, bool Split>
TUTEL_AVX512_QUANT void nvfp4_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows,
                                   const float* const* vectors, float* out, int out_stride) {
  const float* e4m3 = byte_tables().e4m3;
  const __m512 values = e2m1_table();
  const uint8_t* codes[R];
  const uint8_t* scales[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = m.row_codes(expert, rows[r]);
    scales[r] = m.row_byte_scales(expert, rows[r]);
    prefetch_row_scales(m, scales[r]);
  }
  Sums<R, V> sums;
  sums.clear();
  const int64_t blocks = m.cols / kNvfp4Block;  // two per round of 32 elements; the last one may be alone
  for (int64_t b = 0; b < blocks; b += 2) {
    const int halves = b + 1 < blocks ? 2 : 1;
    __m512 w[R][2];
    for (int r = 0; r < R; ++r) {
      if ((b & 7) == 0) prefetch_codes(codes[r] + b * (kNvfp4Block / 2), m.prefetch_bytes);
      if (Split) {
        // A lone block's 8 bytes: the other 8 read as code 0, times the vectors' zero padding.
        const uint8_t* p = codes[r] + b * (kNvfp4Block / 2);
        const __m128i bytes = halves == 2 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                          : _mm_maskz_loadu_epi8(__mmask16(0x00ff), p);
        e2m1_32_split(bytes, values, w[r]);
      } else if (halves == 2) {
        e2m1_32(codes[r] + b * (kNvfp4Block / 2), values, w[r]);
      } else {  // 8 bytes: the other 8 read as code 0 and left unused
        uint8_t part[16] = {0};
        std::memcpy(part, codes[r] + b * (kNvfp4Block / 2), kNvfp4Block / 2);
        e2m1_32(part, values, w[r]);
      }
    }
    if (Split) {  // lanes 0..7 of both halves are the first block's, lanes 8..15 the second's
      __m512 step[2][R];
      for (int r = 0; r < R; ++r) {
        const __m512 first = _mm512_set1_ps(e4m3[scales[r][b]]);
        const __m512 scale = halves == 2 ? _mm512_mask_blend_ps(__mmask16(0xff00), first,
                                                                 _mm512_set1_ps(e4m3[scales[r][b + 1]]))
                                         : first;
        step[0][r] = _mm512_mul_ps(w[r][0], scale);
        step[1][r] = _mm512_mul_ps(w[r][1], scale);
      }
      sums.add(step[0], vectors, b * kNvfp4Block, 0);
      sums.add(step[1], vectors, b * kNvfp4Block + 16, Sums<R, V>::S - 1);
      continue;
    }
    for (int half = 0; half < halves; ++half) {
      __m512 step[R];
      for (int r = 0; r < R; ++r) step[r] = _mm512_mul_ps(w[r][half], _mm512_set1_ps(e4m3[scales[r][b + half]]));
      sums.add(step, vectors, (b + half) * kNvfp4Block, half % Sums<R, V>::S);
    }
  }
  sums.store(out, out_stride, m.global_scale(expert));
}

template <int R, int V>
TUTEL_AVX512_QUANT void fp8_block_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows,
                                       const float* const* vectors, float* out, int out_stride) {
  const uint8_t* codes[R];
  const float* scales[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = m.row_codes(expert, rows[r]);
    scales[r] = m.row_float_scales(expert, rows[r]);
  }
  Sums<R, V> sums;
  sums.clear();
  constexpr int last = Sums<R, V>::S - 1;
  const int64_t width = m.block_cols;
  for (int64_t b = 0, k0 = 0; k0 < m.cols; ++b, k0 += width) {
    const int64_t k1 = std::min(m.cols, k0 + width);
    __m512 scale[R];
    for (int r = 0; r < R; ++r) scale[r] = _mm512_set1_ps(scales[r][b] * 256.0f);
    for (int64_t k = k0; k < k1; k += 32) {  // the block's last round may be short
      const int count = int(std::min<int64_t>(32, k1 - k));
      __m512 w[R][2];
      for (int r = 0; r < R; ++r) {
        if ((k & 63) == 0) prefetch_codes(codes[r] + k, m.prefetch_bytes);
        e4m3_32(codes[r] + k, count, w[r]);
      }
      for (int half = 0; half < 2 && 16 * half < count; ++half) {
        __m512 step[R];
        for (int r = 0; r < R; ++r) step[r] = _mm512_mul_ps(w[r][half], scale[r]);
        const int in_half = count - 16 * half;
        if (in_half >= 16) {
          sums.add(step, vectors, k + 16 * half, half == 0 ? 0 : last);
        } else {  // neither codes nor vectors are read past the block's end
          sums.add_first(step, vectors, k + 16 * half, in_half, half == 0 ? 0 : last);
        }
      }
    }
  }
  sums.store(out, out_stride, 1.0f);
}

template <int R, int V, bool Split>
void dots_of(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, const float* const* vectors, float* out,
             int out_stride) {
  switch (m.format) {
    case QuantFormat::kMxfp4: return mxfp4_dots<R, V, Split>(m, expert, rows, vectors, out, out_stride);
    case QuantFormat::kNvfp4: return nvfp4_dots<R, V, Split>(m, expert, rows, vectors, out, out_stride);
    case QuantFormat::kFp8Block: return fp8_block_dots<R, V>(m, expert, rows, vectors, out, out_stride);
  }
}

template <int R, bool Split>
void rows_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, const float* const* vectors, int count,
               float* out) {
  for (int v0 = 0; v0 < count; v0 += 8) {  // eight vectors at a time
    const float* const* tile = vectors + v0;
    float* tile_out = out + v0;
    switch (std::min(8, count - v0)) {
      case 1: dots_of<R, 1, Split>(m, expert, rows, tile, tile_out, count); break;
      case 2: dots_of<R, 2, Split>(m, expert, rows, tile, tile_out, count); break;
      case 3: dots_of<R, 3, Split>(m, expert, rows, tile, tile_out, count); break;
      case 4: dots_of<R, 4, Split>(m, expert, rows, tile, tile_out, count); break;
      case 5: dots_of<R, 5, Split>(m, expert, rows, tile, tile_out, count); break;
      case 6: dots_of<R, 6, Split>(m, expert, rows, tile, tile_out, count); break;
      case 7: dots_of<R, 7, Split>(m, expert, rows, tile, tile_out, count); break;
      default: dots_of<R, 8, Split>(m, expert, rows, tile, tile_out, count); break;
    }
  }
}

void avx512_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, int row_count,
                 const float* const* vectors, int count, float* out) {
  if (row_count == 2) {
    rows_dots<2, false>(m, expert, rows, vectors, count, out);
  } else {
    rows_dots<1, false>(m, expert, rows, vectors, count, out);
  }
}

void avx512_split_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, int row_count,
                       const float* const* vectors, int count, float* out) {
  if (row_count == 2) {
    rows_dots<2, true>(m, expert, rows, vectors, count, out);
  } else {
    rows_dots<1, true>(m, expert, rows, vectors, count, out);
  }
}

// ---- bfloat16 vectors: AVX512-BF16 dot products -----------------------------------------------
//
// mxfp4: a round of 128 elements is 64 code bytes, read as 32 16-bit words of four codes each.  A
// 16-bit permute of the bfloat16 table indexed by the words gives the values of their first codes
// (the permute reads index bits 0-4, and the table repeats its 16 values), and three more after
// shifts of 4, 8 and 12 bits the second, third and fourth codes'.  vdpbf16ps multiplies each with
// the matching quarter of the round's vector (bf16_layout_slot): float32 lane i sums elements 8i
// to 8i + 7, all of scale block i / 4, so that the four products' sums take the round's four scales
// in one multiply-add, lanes 4b to 4b + 3 the scale of block b.  No permute widens the codes, and
// one per round spreads the scales.

// The scales of a round's four blocks (E8M0 bytes, byte b block b's) as float32 lanes 4b to
// 4b + 3: each byte moved to bits 16-23 of its lanes by a byte shuffle, then into the exponent
// field; exponent byte 0 (2^-127, below float32's normal range) takes its subnormal bits.  Byte
// 255 (NaN) comes out infinite: the rounds flag it (nan_scale_bytes), and the row's sums are NaN.
TUTEL_AVX512_BF16_CODES inline __m512 e8m0_round_scales(uint32_t bytes) {
  const __m512i spread = _mm512_set_epi32(0x80038080, 0x80038080, 0x80038080, 0x80038080,  //
                                          0x80028080, 0x80028080, 0x80028080, 0x80028080,  //
                                          0x80018080, 0x80018080, 0x80018080, 0x80018080,  //
                                          0x80008080, 0x80008080, 0x80008080, 0x80008080);
  const __m512i exponents = _mm512_slli_epi32(_mm512_shuffle_epi8(_mm512_set1_epi32(int(bytes)), spread), 7);
  return _mm512_castsi512_ps(_mm512_max_epu32(exponents, _mm512_set1_epi32(0x00400000)));
}

// Nonzero where one of the four bytes is 255 (E8M0's NaN): a byte of ~bytes that is zero.  Scalar
// work, on ports the vector decoding leaves idle.
inline uint32_t nan_scale_bytes(uint32_t bytes) {
  const uint32_t inverted = ~bytes;
  return (inverted - 0x01010101u) & ~inverted & 0x80808080u;
}

// One round of each row (the codes at byte offset 64q, scale blocks 4q to 4q + 3) into acc.
// Whole: 128 elements; otherwise the row's last `blocks` (1 to 3) scale blocks, whose missing codes
// and scales are read as zeros (the vectors' padding is zero too).
template <int R, int V, bool Whole>
TUTEL_AVX512_BF16_CODES inline void mxfp4_bf16_round(const uint8_t* const (&codes)[R],
                                                     const uint8_t* const (&scales)[R], __m512i table,
                                                     const uint16_t* const* vectors, int64_t q, int blocks,
                                                     int64_t prefetch, __m512 (&acc)[R][V],
                                                     uint32_t (&nan_scales)[R]) {
  __m512i w[R][4];
  __m512 scale[R];
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = codes[r] + q * 64;
    const uint8_t* s = scales[r] + q * 4;
    prefetch_codes(p, prefetch);
    uint32_t four = 0;
    __m512i words;
    if (Whole) {
      std::memcpy(&four, s, 4);
      words = _mm512_loadu_si512(p);
    } else {
      for (int b = 0; b < blocks; ++b) four |= uint32_t(s[b]) << (8 * b);
      words = _mm512_maskz_loadu_epi8(~0ull >> (64 - 16 * blocks), p);
    }
    w[r][0] = _mm512_permutexvar_epi16(words, table);
    w[r][1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
    w[r][2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 8), table);
    w[r][3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), table);
    scale[r] = e8m0_round_scales(four);
    nan_scales[r] |= nan_scale_bytes(four);
  }
  for (int v = 0; v < V; ++v) {
    const uint16_t* x = vectors[v] + q * 128;
    __m512i quarter[4];
    for (int j = 0; j < 4; ++j) quarter[j] = _mm512_loadu_si512(x + 32 * j);
    for (int r = 0; r < R; ++r) {
      __m512 dots = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w[r][0], (__m512bh)quarter[0]);
      for (int j = 1; j < 4; ++j) dots = _mm512_dpbf16_ps(dots, (__m512bh)w[r][j], (__m512bh)quarter[j]);
      acc[r][v] = _mm512_fmadd_ps(dots, scale[r], acc[r][v]);
    }
  }
}

template <int R, int V>
TUTEL_AVX512_BF16_CODES void mxfp4_bf16_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows,
                                             const uint16_t* const* vectors, float* out, int out_stride) {
  const __m512i table = e2m1_bf16_table();
  const uint8_t* codes[R];
  const uint8_t* scales[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = m.row_codes(expert, rows[r]);
    scales[r] = m.row_byte_scales(expert, rows[r]);
    prefetch_row_scales(m, scales[r]);
  }
  __m512 acc[R][V];
  uint32_t nan_scales[R] = {};
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t whole = m.cols / 128;
  for (int64_t q = 0; q < whole; ++q) {
    mxfp4_bf16_round<R, V, true>(codes, scales, table, vectors, q, 4, m.prefetch_bytes, acc, nan_scales);
  }
  if (const int rest = int(m.cols % 128 / kMxfp4Block)) {
    mxfp4_bf16_round<R, V, false>(codes, scales, table, vectors, whole, rest, m.prefetch_bytes, acc, nan_scales);
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      const float sum = _mm512_reduce_add_ps(acc[r][v]);
      out[r * out_stride + v] = nan_scales[r] ? std::numeric_limits<float>::quiet_NaN() : sum;
    }
  }
}

// fp8_block with bfloat16 vectors in the fp8 bfloat16 layout (rounds of 64): a round's 64 E4M3
// bytes look up the bytes of their bfloat16 bits (quant_codes_avx512_bf16.h), and two byte unpacks
// pair them into bfloat16 lanes.  The unpacks work within 16-byte lanes, which is why the vectors'
// rounds hold their elements in the order the bfloat16 lanes come out (bf16_layout_slot).  A scale
// block's rounds sum in float32 lanes, which then take the block's scale in one multiply-add.
//
// The bfloat16 bits of a round's 64 codes (the first `count`, zeros past them), in the layout's
// order: w[0] the round's first 32 slots, w[1] the last 32.
TUTEL_AVX512_BF16_CODES inline void e4m3_bf16_round(const uint8_t* p, int count, const E4m3Bf16Tables& t,
                                                    __m512i (&w)[2]) {
  const __m512i codes = count >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << count) - 1, p);
  __m512i lows, highs;
  e4m3_bf16_bytes(codes, t, lows, highs);
  w[0] = _mm512_unpacklo_epi8(lows, highs);
  w[1] = _mm512_unpackhi_epi8(lows, highs);
}

template <int R, int V>
TUTEL_AVX512_BF16_CODES void fp8_block_bf16_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows,
                                                 const uint16_t* const* vectors, float* out, int out_stride) {
  const E4m3Bf16Tables& tables = e4m3_bf16_tables();
  const uint8_t* codes[R];
  const float* scales[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = m.row_codes(expert, rows[r]);
    scales[r] = m.row_float_scales(expert, rows[r]);
  }
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t width = m.block_cols;  // whole rounds (bf16_takes)
  for (int64_t b = 0, k0 = 0; k0 < m.cols; ++b, k0 += width) {
    const int64_t k1 = std::min(m.cols, k0 + width);
    __m512 dots[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) dots[r][v] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 64) {  // only the row's last round is partial
      const int count = int(std::min<int64_t>(64, k1 - k));
      __m512i w[R][2];
      for (int r = 0; r < R; ++r) {
        prefetch_codes(codes[r] + k, m.prefetch_bytes);
        e4m3_bf16_round(codes[r] + k, count, tables, w[r]);
      }
      for (int v = 0; v < V; ++v) {
        // zeros past the row: the layout's padding
        const __m512i x0 = _mm512_loadu_si512(vectors[v] + k), x1 = _mm512_loadu_si512(vectors[v] + k + 32);
        for (int r = 0; r < R; ++r) {
          dots[r][v] = _mm512_dpbf16_ps(dots[r][v], (__m512bh)w[r][0], (__m512bh)x0);
          dots[r][v] = _mm512_dpbf16_ps(dots[r][v], (__m512bh)w[r][1], (__m512bh)x1);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(scales[r][b]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(dots[r][v], scale, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) out[r * out_stride + v] = _mm512_reduce_add_ps(acc[r][v]);
}

template <int R, int V>
TUTEL_AVX512_BF16_CODES void bf16_dots_of(const QuantizedMatrix& m, int64_t expert, const int64_t* rows,
                                          const uint16_t* const* vectors, float* out, int out_stride) {
  if (m.format == QuantFormat::kFp8Block) {
    fp8_block_bf16_dots<R, V>(m, expert, rows, vectors, out, out_stride);
  } else {
    mxfp4_bf16_dots<R, V>(m, expert, rows, vectors, out, out_stride);
  }
}

template <int R>
void rows_bf16_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, const uint16_t* const* vectors,
                    int count, float* out) {
  for (int v0 = 0; v0 < count; v0 += 4) {  // four vectors at a time: 2 x R x 4 sums stay in registers
    const uint16_t* const* tile = vectors + v0;
    float* tile_out = out + v0;
    switch (std::min(4, count - v0)) {
      case 1: bf16_dots_of<R, 1>(m, expert, rows, tile, tile_out, count); break;
      case 2: bf16_dots_of<R, 2>(m, expert, rows, tile, tile_out, count); break;
      case 3: bf16_dots_of<R, 3>(m, expert, rows, tile, tile_out, count); break;
      default: bf16_dots_of<R, 4>(m, expert, rows, tile, tile_out, count); break;
    }
  }
}

// mxfp4, and fp8_block with blocks a multiple of 64 wide (bf16_takes).  Four rows of one vector run
// together (a one-token step: fewer calls per row, and more independent sums in flight); with more
// vectors, whose sums take the registers, two rows at a time.
void avx512_bf16_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, int row_count,
                      const uint16_t* const* vectors, int count, float* out) {
  if (row_count == 4 && count == 1) {
    bf16_dots_of<4, 1>(m, expert, rows, vectors, out, 1);
    return;
  }
  for (int r = 0; r < row_count; r += 2) {
    if (row_count - r >= 2) {
      rows_bf16_dots<2>(m, expert, rows + r, vectors, count, out + r * count);
    } else {
      rows_bf16_dots<1>(m, expert, rows + r, vectors, count, out + r * count);
    }
  }
}

// AVX512-BF16's dot products, and VBMI's byte permutes for the E4M3 tables.
bool cpu_has_avx512_bf16() {
  static const bool supported = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
  return supported;
}

// What the kernels need of the CPU, and of the OS (__builtin_cpu_supports checks that it saves
// the 512-bit state).
bool cpu_has_avx512_quant() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && avx2::cpu_has_avx2_fma();
  return supported;
}

}  // namespace
#endif

const QuantKernels* avx512_quant_kernels() {
#ifdef TUTEL_HAVE_AVX2_KERNELS
  static const QuantKernels kernels{&avx512_dots, "avx512", &avx512_split_dots};
  if (cpu_has_avx512_quant()) return &kernels;
#endif
  return nullptr;
}

const QuantKernels* avx512_bf16_quant_kernels() {
#ifdef TUTEL_HAVE_AVX2_KERNELS
  static const QuantKernels kernels{&avx512_dots, "avx512_bf16", &avx512_split_dots, &avx512_bf16_dots};
  if (cpu_has_avx512_quant() && cpu_has_avx512_bf16()) return &kernels;
#endif
  return nullptr;
}

}  // namespace core
}  // namespace tutel
