// E2M1 and E4M3 codes decoded straight to bfloat16 bits in AVX-512 registers, with AVX512-BF16's
// conversion and VBMI's byte permutes: what the bfloat16 decode kernels (quantized_decode_avx512.cpp)
// and the bfloat16 strips of the CPU GEMM (gemm/quantized_products_avx512.cpp) read the codes with.
//
//   E2M1: a 16-entry table of the signed values (scaled first, where a scale applies, and rounded
//     to bfloat16 once) indexed by the nibbles with 16-bit permutes.
//   E4M3: every E4M3 value, subnormals included, is a normal bfloat16, so two 128-entry byte tables
//     (seven index bits: the code without its sign) give the low and the high byte of the
//     magnitude's bfloat16 bits, and the code's sign bit goes into the high byte.  NaN codes look up
//     a NaN.
//
// Every function carries TUTEL_AVX512_BF16_CODES, so the files including this compile with the
// baseline flags and their code runs only after a CPU check (AVX512-BF16 and VBMI).
#pragma once

#include "quant_codes_avx512.h"

#ifdef TUTEL_HAVE_AVX2_KERNELS
#include <cstring>

#include "quant_codes.h"

#define TUTEL_AVX512_BF16_CODES __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")))

namespace tutel {
namespace core {
namespace avx512_codes {

// The 16 E2M1 values' bfloat16 bits, repeated: a 16-bit permute reads index bits 0-4.
TUTEL_AVX512_BF16_CODES inline __m512i e2m1_bf16_table() {
  return _mm512_setr_epi32(0x3f000000, 0x3fc03f80, 0x40404000, 0x40c04080, 0xbf008000, 0xbfc0bf80, 0xc040c000,
                           0xc0c0c080, 0x3f000000, 0x3fc03f80, 0x40404000, 0x40c04080, 0xbf008000, 0xbfc0bf80,
                           0xc040c000, 0xc0c0c080);
}

// Byte m of `bytes` (one per 32-bit lane) as the 16-bit permute indices of its two codes: word 2m
// the whole byte (the low nibble in bits 0-3; bit 4 is the high nibble's, which the repeated
// tables ignore and the two-block tables clear), word 2m + 1 the high nibble.  byte * 0x1001 is
// byte | byte << 12, whose high word is byte >> 4.
TUTEL_AVX512_BF16_CODES inline __m512i e2m1_pair_indices(__m512i bytes) {
  return _mm512_madd_epi16(bytes, _mm512_set1_epi32(0x1001));
}

// The 32 values of the codes in 16 bytes at p times `scale` (each product rounded to float32, then
// to bfloat16 once), as bfloat16 bits in element order.
TUTEL_AVX512_BF16_CODES inline __m512i e2m1_bf16_32(const uint8_t* p, float scale) {
  const __m512 scaled = _mm512_mul_ps(e2m1_table(), _mm512_set1_ps(scale));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(scaled, scaled);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_permutexvar_epi16(e2m1_pair_indices(bytes), table);
}

// The same for two blocks of 16 codes (8 bytes each) with a scale each; `whole` false: the first
// block alone (the second's 8 bytes are not read, and its values are those of code 0).
TUTEL_AVX512_BF16_CODES inline __m512i e2m1_bf16_two_blocks(const uint8_t* p, float first, float second, bool whole) {
  const __m512 table = e2m1_table();
  // entries 0-15: the first block's values, 16-31 the second's
  const __m512i tables = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(table, _mm512_set1_ps(second)),
                                                       _mm512_mul_ps(table, _mm512_set1_ps(first)));
  const __m128i codes = whole ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                              : _mm_maskz_loadu_epi8(__mmask16(0x00ff), p);
  const __m512i pairs = e2m1_pair_indices(_mm512_cvtepu8_epi32(codes));
  // (pairs & 0x000f000f) | bit 4 in the words of bytes 8-15, the second block's
  const __m512i block = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x00100010, 0x00100010, 0x00100010, 0x00100010,
                                          0x00100010, 0x00100010, 0x00100010, 0x00100010);
  const __m512i indices = _mm512_ternarylogic_epi32(pairs, _mm512_set1_epi32(0x000f000f), block, 0xea);
  return _mm512_permutexvar_epi16(indices, tables);
}

struct E4m3Bf16Tables {
  __m512i low[2], high[2];  // the low and the high bytes of magnitudes 0..127's bfloat16 bits
};

TUTEL_AVX512_BF16_CODES inline E4m3Bf16Tables make_e4m3_bf16_tables() {
  alignas(64) uint8_t low[128], high[128];
  const float* e4m3 = byte_tables().e4m3;
  for (int c = 0; c < 128; ++c) {
    uint32_t u;
    std::memcpy(&u, &e4m3[c], 4);
    // exact: E4M3 values have at most 4 significant bits
    low[c] = uint8_t(u >> 16);
    high[c] = uint8_t(u >> 24);
  }
  E4m3Bf16Tables t;
  for (int h = 0; h < 2; ++h) {
    t.low[h] = _mm512_load_si512(low + 64 * h);
    t.high[h] = _mm512_load_si512(high + 64 * h);
  }
  return t;
}

TUTEL_AVX512_BF16_CODES inline const E4m3Bf16Tables& e4m3_bf16_tables() {
  static const E4m3Bf16Tables tables = make_e4m3_bf16_tables();
  return tables;
}

// The low and the high bytes of the bfloat16 bits of the 64 codes in `codes`, byte for byte.
TUTEL_AVX512_BF16_CODES inline void e4m3_bf16_bytes(__m512i codes, const E4m3Bf16Tables& t, __m512i& lows,
                                                    __m512i& highs) {
  lows = _mm512_permutex2var_epi8(t.low[0], codes, t.low[1]);
  // high | (codes & 0x80): the sign bit in place (the magnitudes' is clear)
  highs = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.high[0], codes, t.high[1]), codes,
                                    _mm512_set1_epi8(int8_t(0x80)), 0xf8);
}

// The 64 E4M3 codes at p times `scale` (each product rounded to float32, then to bfloat16 once),
// as bfloat16 bits in element order: w[0] elements 0..31.  The codes' 4-byte groups are first
// transposed (group 4l + q from group 4q + l) so that the in-lane unpacks into bfloat16 and then
// float32 lanes leave elements 0-15, 16-31, 32-47 and 48-63 in order.
TUTEL_AVX512_BF16_CODES inline void e4m3_bf16_64(const uint8_t* p, __m512 scale, const E4m3Bf16Tables& t,
                                                 __m512i (&w)[2]) {
  const __m512i groups = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i codes = _mm512_permutexvar_epi32(groups, _mm512_loadu_si512(p));
  __m512i lows, highs;
  e4m3_bf16_bytes(codes, t, lows, highs);
  const __m512i first = _mm512_unpacklo_epi8(lows, highs), second = _mm512_unpackhi_epi8(lows, highs);
  const __m512i zero = _mm512_setzero_si512();
  const __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, first)), scale);
  const __m512 b = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, first)), scale);
  const __m512 c = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, second)), scale);
  const __m512 d = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, second)), scale);
  w[0] = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  w[1] = (__m512i)_mm512_cvtne2ps_pbh(d, c);
}

}  // namespace avx512_codes
}  // namespace core
}  // namespace tutel
#endif
