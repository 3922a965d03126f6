// Sixteen floats in an AVX-512 register, the storage types they come from and go to, and the CPU
// check the AVX-512 kernels share (skinny_avx512_dot.h, skinny_gemm_avx512.cpp, tile_gemm_amx.cpp).
//
// As in avx2_lanes.h every function carries its own target attribute, so the files including this
// compile with the baseline flags and their code runs only after cpu_has_avx512().  Functions
// compiled for a wider target (AVX512-BF16, AMX) inline these.
#pragma once

#include "../core/avx2_lanes.h"

#ifdef TUTEL_HAVE_AVX2_KERNELS

#define TUTEL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

namespace tutel {
namespace gemm {
namespace avx512 {

// What the AVX-512 kernels need of the CPU (and of the OS: __builtin_cpu_supports checks that it
// saves the 512-bit state).
inline bool cpu_has_avx512() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return supported;
}

// Sixteen bfloat16 values (their bits) as sixteen floats.
TUTEL_AVX512 inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Sixteen floats stored as T, eight at a time through avx2_lanes.h's stores (16-bit values rounded
// as scalar.h rounds them, NaN written as it writes it).
template <class T>
TUTEL_AVX512 inline void store16(T* p, __m512 v) {
  core::avx2::Lanes<T>::store(p, _mm512_extractf32x8_ps(v, 0));
  core::avx2::Lanes<T>::store(p + 8, _mm512_extractf32x8_ps(v, 1));
}

// Sixteen floats as bfloat16 bits in the low halves of their 32-bit lanes, rounded as
// avx2::Lanes<bfloat16>::store rounds (to nearest even, NaN as 0x7fc0); and stored in one 512-bit
// pass: the same bits, without splitting the register in halves.
TUTEL_AVX512 inline __m512i bf16_lanes(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

TUTEL_AVX512 inline void store16(core::bfloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_lanes(v)));
}

// 32 floats (first: elements 0..15) as 32 bfloat16 values in one register, rounded as store16.
TUTEL_AVX512 inline __m512i bf16_32(__m512 first, __m512 second) {
  // 16-bit element 2 m of a 32-bit lane holds its rounded value: the even elements of both.
  alignas(64) static const uint16_t kEven[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                 32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  return _mm512_permutex2var_epi16(bf16_lanes(first), _mm512_load_si512(kEven), bf16_lanes(second));
}

// Transposes a 16 x 16 block of 32-bit lanes held as 16 rows.
TUTEL_AVX512 inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4 j + m]'s 128-bit lane L: column 4 L + m of rows 4 j .. 4 j + 3.
  for (int j = 0; j < 4; ++j) {
    u[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
    u[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
    u[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
    u[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i even_lo = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);  // lanes 0, 2 of each
    const __m512i even_hi = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i odd_lo = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);  // lanes 1, 3 of each
    const __m512i odd_hi = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
    r[m] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xdd);
    r[4 + m] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xdd);
  }
}

}  // namespace avx512
}  // namespace gemm
}  // namespace tutel
#endif
