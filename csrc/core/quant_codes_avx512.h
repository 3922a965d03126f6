// E2M1 and E4M3 codes decoded in AVX-512 registers, 32 at a time: what the quantized decode
// kernels (quantized_decode_avx512.cpp) and the quantized tile products of the CPU GEMM
// (gemm/quantized_products_avx512.cpp, gemm/quantized_tiles_amx.cpp) read the codes with.
//
//   E2M1: 16 bytes (32 codes) widened to one byte per 32-bit lane; the low and the high nibbles
//     index a 16-entry table of the signed values (scaled by the block's scale) with one permute
//     each, giving the even and the odd elements, which two two-source permutes put back in order.
//   E4M3: 32 bytes rebuilt as float16 bits with 16-bit shifts and compare masks, converted 16 at
//     a time.
//
// Every function carries TUTEL_AVX512_QUANT, so the files including this compile with the baseline
// flags and their code runs only after a CPU check; functions of a wider target inline these.
#pragma once

#include "avx2_lanes.h"

#ifdef TUTEL_HAVE_AVX2_KERNELS
#include <cstdint>

#define TUTEL_AVX512_QUANT __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace tutel {
namespace core {
namespace avx512_codes {

// The 16 E2M1 values in code order.
TUTEL_AVX512_QUANT inline __m512 e2m1_table() {
  return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f,
                        -4.0f, -6.0f);
}

// The 32 values of the codes in 16 bytes at p, in element order (w[0]: elements 0..15).
TUTEL_AVX512_QUANT inline void e2m1_32(const uint8_t* p, __m512 table, __m512 (&w)[2]) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), table);
  const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  // Lane 2m takes even[m], lane 2m + 1 odd[m] (index bit 4 picks the second source).
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  w[0] = _mm512_permutex2var_ps(even, first, odd);
  w[1] = _mm512_permutex2var_ps(even, second, odd);
}

// The 32 values of the codes in `bytes` split by parity: w[0] the even elements (the low nibbles),
// w[1] the odd ones (the high nibbles), each in element order.
TUTEL_AVX512_QUANT inline void e2m1_32_split(__m128i bytes, __m512 table, __m512 (&w)[2]) {
  const __m512i wide = _mm512_cvtepu8_epi32(bytes);
  w[0] = _mm512_permutexvar_ps(_mm512_and_si512(wide, _mm512_set1_epi32(15)), table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), table);
}

// `count` (up to 32) E4M3 bytes as floats times 2^-8 (w[0]: elements 0..15; past `count` 0): each
// byte in the high half of a 16-bit lane, shifted right by one with its sign repeated, and bit 14
// cleared, is the float16 with the sign, exponent and mantissa bits in their places; NaN codes
// become a float16 NaN.
TUTEL_AVX512_QUANT inline void e4m3_32(const uint8_t* p, int count, __m512 (&w)[2]) {
  const __mmask32 kept = count >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << count) - 1);
  const __m512i high = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(kept, p)), 8);
  const __m512i half = _mm512_and_si512(_mm512_srai_epi16(high, 1), _mm512_set1_epi16(int16_t(0xbf80)));
  const __m512i all_ones = _mm512_set1_epi16(0x3f80);
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(half, all_ones), all_ones);
  const __m512i bits = _mm512_mask_mov_epi16(half, nan, _mm512_set1_epi16(0x7e00));
  w[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(bits));
  w[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1));
}

}  // namespace avx512_codes
}  // namespace core
}  // namespace tutel
#endif
