// AVX2 + FMA + F16C kernels of decode_quantized_experts (quantized_decode.h): the dot products of
// one or two quantized rows with up to four float vectors at a time, the codes decoded in
// registers, eight elements per step.
//
//   E2M1: the 4 bytes of 8 codes broadcast to every lane and shifted right by 4 x lane, so that
//     lane l holds code l in its low nibble (element 2j is byte j's low nibble); the magnitude is
//     a permute of the eight magnitudes (scaled by the block's scale once per block) by the low
//     three bits, the sign bit 3 moved to bit 31 and xored in.
//   E4M3: each byte widened to 16 bits and rebuilt as the float16 with the same exponent and
//     mantissa bits (its value is the E4M3 value x 2^-8, subnormals included), the NaN codes made
//     float16 NaNs, then converted by F16C; the 2^8 is folded into the block's scale.
//
// Each (row, vector) pair keeps its own sums; with fewer than four pairs each keeps several, so
// that enough independent FMA chains run to hide the FMA latency.
#include <algorithm>
#include <cstring>

#include "avx2_lanes.h"
#include "quantized_decode.h"

namespace tutel {
namespace core {

#ifdef TUTEL_HAVE_AVX2_KERNELS
namespace {

// Independent sums per (row, vector) pair for R rows and V vectors.
constexpr int sums_per_pair(int pairs) { return pairs >= 4 ? 1 : (pairs == 1 ? 4 : 2); }

TUTEL_AVX2_FMA inline __m256 e2m1_lanes(__m256 table, __m256i shifts, const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  const __m256i nibbles = _mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts);
  const __m256 magnitude = _mm256_permutevar8x32_ps(table, nibbles);  // uses the low 3 bits only
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(nibbles, 28), _mm256_set1_epi32(int(0x80000000u)));
  return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
}

// 8 E4M3 bytes as floats times 2^-8.
TUTEL_AVX2_FMA inline __m256 e4m3_lanes(const uint8_t* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i low7 = _mm_and_si128(bytes, _mm_set1_epi16(0x7f));
  const __m128i magnitude = _mm_slli_epi16(low7, 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8);
  const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(low7, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7c00));
  return _mm256_cvtph_ps(_mm_or_si128(_mm_or_si128(magnitude, sign), nan));
}

// Prefetches the line `ahead` bytes past p (nothing for ahead 0; prefetches never fault).
inline void prefetch_codes(const uint8_t* p, int64_t ahead) {
  if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
}

TUTEL_AVX2_FMA inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R, int V>
struct Sums {
  static constexpr int S = sums_per_pair(R * V);
  __m256 acc[R][V][S];

  TUTEL_AVX2_FMA void clear() {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v)
        for (int s = 0; s < S; ++s) acc[r][v][s] = _mm256_setzero_ps();
  }
  // acc[r][v][slot] += w[r] * vectors[v][k .. k + 7]
  TUTEL_AVX2_FMA void add(const __m256 (&w)[R], const float* const* vectors, int64_t k, int slot) {
    for (int v = 0; v < V; ++v) {
      const __m256 x = _mm256_loadu_ps(vectors[v] + k);
      for (int r = 0; r < R; ++r) acc[r][v][slot] = _mm256_fmadd_ps(w[r], x, acc[r][v][slot]);
    }
  }
  // The same for the first `count` (< 8) elements only: the others of the vectors are not read.
  TUTEL_AVX2_FMA void add_first(const __m256 (&w)[R], const float* const* vectors, int64_t k, int count) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i kept = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes);
    for (int v = 0; v < V; ++v) {
      const __m256 x = _mm256_maskload_ps(vectors[v] + k, kept);
      for (int r = 0; r < R; ++r) acc[r][v][0] = _mm256_fmadd_ps(w[r], x, acc[r][v][0]);
    }
  }
  TUTEL_AVX2_FMA void store(float* out, int out_stride, float scale) const {
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < V; ++v) {
        __m256 total = acc[r][v][0];
        for (int s = 1; s < S; ++s) total = _mm256_add_ps(total, acc[r][v][s]);
        out[r * out_stride + v] = horizontal_sum(total) * scale;
      }
    }
  }
};

// Four steps of 8 from element k on, the weights of row r made by decode(r, c) for step c.
template <int R, int V, class Decode>
TUTEL_AVX2_FMA inline void four_steps(Sums<R, V>& sums, const float* const* vectors, int64_t k, Decode decode) {
  constexpr int S = Sums<R, V>::S;
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    __m256 w[R];
    for (int r = 0; r < R; ++r) w[r] = decode(r, c);
    sums.add(w, vectors, k + 8 * c, c % S);
  }
}

template <int R, int V>
TUTEL_AVX2_FMA void mxfp4_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows,
                               const float* const* vectors, float* out, int out_stride) {
  const float* e8m0 = byte_tables().e8m0;
  const __m256 magnitudes = _mm256_loadu_ps(kE2M1Magnitudes);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
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
    __m256 table[R];
    for (int r = 0; r < R; ++r) {
      if ((b & 3) == 0) prefetch_codes(codes[r] + b * (kMxfp4Block / 2), m.prefetch_bytes);
      table[r] = _mm256_mul_ps(magnitudes, _mm256_set1_ps(e8m0[scales[r][b]]));
    }
    four_steps(sums, vectors, b * kMxfp4Block, [&](int r, int c) TUTEL_AVX2_FMA {
      return e2m1_lanes(table[r], shifts, codes[r] + b * (kMxfp4Block / 2) + 4 * c);
    });
  }
  sums.store(out, out_stride, 1.0f);
}

template <int R, int V>
TUTEL_AVX2_FMA void nvfp4_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows,
                               const float* const* vectors, float* out, int out_stride) {
  const float* e4m3 = byte_tables().e4m3;
  const __m256 magnitudes = _mm256_loadu_ps(kE2M1Magnitudes);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const uint8_t* codes[R];
  const uint8_t* scales[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = m.row_codes(expert, rows[r]);
    scales[r] = m.row_byte_scales(expert, rows[r]);
    prefetch_row_scales(m, scales[r]);
  }
  Sums<R, V> sums;
  sums.clear();
  const int64_t blocks = m.cols / kNvfp4Block;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {  // two scale blocks, 32 elements, per round
    __m256 table[R][2];
    for (int r = 0; r < R; ++r) {
      if ((b & 7) == 0) prefetch_codes(codes[r] + b * (kNvfp4Block / 2), m.prefetch_bytes);
      table[r][0] = _mm256_mul_ps(magnitudes, _mm256_set1_ps(e4m3[scales[r][b]]));
      table[r][1] = _mm256_mul_ps(magnitudes, _mm256_set1_ps(e4m3[scales[r][b + 1]]));
    }
    four_steps(sums, vectors, b * kNvfp4Block, [&](int r, int c) TUTEL_AVX2_FMA {
      return e2m1_lanes(table[r][c >> 1], shifts, codes[r] + b * (kNvfp4Block / 2) + 4 * c);
    });
  }
  if (b < blocks) {  // a last block of 16
    for (int c = 0; c < 2; ++c) {
      __m256 w[R];
      for (int r = 0; r < R; ++r) {
        const __m256 table = _mm256_mul_ps(magnitudes, _mm256_set1_ps(e4m3[scales[r][b]]));
        w[r] = e2m1_lanes(table, shifts, codes[r] + b * (kNvfp4Block / 2) + 4 * c);
      }
      sums.add(w, vectors, b * kNvfp4Block + 8 * c, 0);
    }
  }
  sums.store(out, out_stride, m.global_scale(expert));
}

template <int R, int V>
TUTEL_AVX2_FMA void fp8_block_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows,
                                   const float* const* vectors, float* out, int out_stride) {
  const uint8_t* codes[R];
  const float* scales[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = m.row_codes(expert, rows[r]);
    scales[r] = m.row_float_scales(expert, rows[r]);
  }
  Sums<R, V> sums;
  sums.clear();
  const int64_t width = m.block_cols;
  for (int64_t b = 0, k0 = 0; k0 < m.cols; ++b, k0 += width) {
    const int64_t k1 = std::min(m.cols, k0 + width);
    __m256 scale[R];
    for (int r = 0; r < R; ++r) scale[r] = _mm256_set1_ps(scales[r][b] * 256.0f);
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      if ((k & 63) == 0) {
        for (int r = 0; r < R; ++r) prefetch_codes(codes[r] + k, m.prefetch_bytes);
      }
      four_steps(sums, vectors, k, [&](int r, int c) TUTEL_AVX2_FMA {
        return _mm256_mul_ps(e4m3_lanes(codes[r] + k + 8 * c), scale[r]);
      });
    }
    for (; k + 8 <= k1; k += 8) {
      __m256 w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm256_mul_ps(e4m3_lanes(codes[r] + k), scale[r]);
      sums.add(w, vectors, k, 0);
    }
    if (k < k1) {  // the block's last elements; neither codes nor vectors are read past them
      __m256 w[R];
      for (int r = 0; r < R; ++r) {
        uint8_t part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        std::memcpy(part, codes[r] + k, size_t(k1 - k));
        w[r] = _mm256_mul_ps(e4m3_lanes(part), scale[r]);
      }
      sums.add_first(w, vectors, k, int(k1 - k));
    }
  }
  sums.store(out, out_stride, 1.0f);
}

template <int R, int V>
void dots_of(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, const float* const* vectors, float* out,
             int out_stride) {
  switch (m.format) {
    case QuantFormat::kMxfp4: return mxfp4_dots<R, V>(m, expert, rows, vectors, out, out_stride);
    case QuantFormat::kNvfp4: return nvfp4_dots<R, V>(m, expert, rows, vectors, out, out_stride);
    case QuantFormat::kFp8Block: return fp8_block_dots<R, V>(m, expert, rows, vectors, out, out_stride);
  }
}

template <int R>
void rows_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, const float* const* vectors, int count,
               float* out) {
  for (int v0 = 0; v0 < count; v0 += 4) {  // four vectors at a time
    switch (std::min(4, count - v0)) {
      case 1: dots_of<R, 1>(m, expert, rows, vectors + v0, out + v0, count); break;
      case 2: dots_of<R, 2>(m, expert, rows, vectors + v0, out + v0, count); break;
      case 3: dots_of<R, 3>(m, expert, rows, vectors + v0, out + v0, count); break;
      default: dots_of<R, 4>(m, expert, rows, vectors + v0, out + v0, count); break;
    }
  }
}

void avx2_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, int row_count,
               const float* const* vectors, int count, float* out) {
  if (row_count == 2) {
    rows_dots<2>(m, expert, rows, vectors, count, out);
  } else {
    rows_dots<1>(m, expert, rows, vectors, count, out);
  }
}

}  // namespace
#endif

const QuantKernels* avx2_quant_kernels() {
#ifdef TUTEL_HAVE_AVX2_KERNELS
  static const QuantKernels kernels{&avx2_dots, "avx2", nullptr};
  if (avx2::cpu_has_avx2_fma()) return &kernels;
#endif
  return nullptr;
}

}  // namespace core
}  // namespace tutel
