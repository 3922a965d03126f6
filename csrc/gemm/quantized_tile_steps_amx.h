// One step (32 inner values) of 16 quantized matrix rows decoded straight into an AMX B tile, for
// the tile products of quantized_tiles_amx.cpp: no float32 rows and no 16 x 16 transpose of 32-bit
// lanes.  B tile row p holds, for each of the 16 matrix rows n, the bfloat16 pair of inner values
// (2p, 2p + 1) in 32-bit lane n.  For the fp4 formats that pair is one code byte of row n, for
// fp8_block two: the step's code bytes are transposed as bytes (two-source byte permutes, which
// leave every byte where the decoding wants it) and each tile row decoded as it comes out:
//
// * mxfp4: the E2M1 codes index a table of their bfloat16 bits (one 16-bit permute), and the block
//   scale 2^(s - 127) is added to the exponent bits of the nonzero values: exact, where every
//   nonzero value stays a normal bfloat16 (2 <= s <= 252);
// * nvfp4: the codes index the float32 table, times the block's float32 factor (scale * global)
//   per lane, both halves rounded to bfloat16 by one conversion and put in pair order;
// * fp8_block, where the 16 rows share the step's scale s (a block row holds whole tiles): each code
//   looks up bfloat16(E4M3 magnitude * s) in a 128-entry table built once per scale block (two byte
//   permutes, the low and the high bytes), and takes the code's sign;
// * fp8_block otherwise: the E4M3 bytes become float16 bits (quant_codes_avx512.h's way), float32,
//   times the block's scale (times 256, as decode_step takes it) per lane, rounded to bfloat16 pairs.
//
// Each step's per-lane constants (tile rows' scale terms) come from the caller, which also says for
// which steps these give the bits the transposed decode_step does (quantized_steps_avx512.h then
// bf16_32's rounding): the conversion instruction treats subnormal floats as zero and NaN as its
// own bits, so the caller sends steps whose scales could make either to that way instead.
//
// The rows' codes are read through 16 pointers: the caller points rows past the matrix at zeros.
//
// Every function carries TUTEL_AMX_DECODE: they run only after quantized_tile_steps_available().
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>

#include <cstdint>

#include "amx_tiles.h"

#define TUTEL_AMX_DECODE \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,fma,f16c,amx-tile,amx-bf16")))

namespace tutel {
namespace gemm {
namespace quantized_tile_steps {

using amx_tiles::PackedTile;

// What the step decoders need beyond AMX: byte permutes (VBMI) and the bfloat16 conversion.
inline bool quantized_tile_steps_available() {
  static const bool supported = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
  return supported;
}

// The byte permutes' indices, built once.  A two-source byte permute takes byte i of its result
// from byte index[i] of (first source, second source) read as 128 bytes.
struct Shuffles {
  // fp4 (16 rows x 16 code bytes, rows 4 q .. 4 q + 3 in source q): quad_to_octet[h] takes code
  // bytes 8 h .. 8 h + 7 of rows 0..7 of sources (2 a, 2 a + 1), byte 8 c + r = row r's byte 8 h + c;
  // octet_to_lanes[c] then puts row n's byte c (sources: rows 0..7, rows 8..15) at bytes 4 n and 4 n + 2.
  alignas(64) uint8_t quad_to_octet[2][64];
  alignas(64) uint8_t octet_to_lanes[8][64];
  // fp8 (16 rows x 32 code bytes, rows 2 q, 2 q + 1 in source q), in byte pairs (one tile row's pair):
  // pairs_1[h]: rows 0..3 of sources (2 a, 2 a + 1), pairs 8 h .. 8 h + 7, byte 2 (4 c + r) + odd;
  // pairs_2[g]: rows 0..7 of two of those, pairs 4 g .. 4 g + 3 of them, byte 2 (8 c + r) + odd;
  // pairs_3[c]: pair c of 16 rows of two of those, row n's byte odd at bytes 4 n + 2 odd and
  // 4 n + 2 odd + 1 (both bytes of 16-bit lane 2 n + odd).
  alignas(64) uint8_t pairs_1[2][64];
  alignas(64) uint8_t pairs_2[2][64];
  alignas(64) uint8_t pairs_3[4][64];
  // pair_rows[w]: the codes of tile rows p and p + 1, p % 4 = 2 w (those of pairs_3[2 w] and
  // pairs_3[2 w + 1]), once each, in the order two byte unpacks pair them: bytes 16 j + i and
  // 16 j + 8 + i (i < 8) hold the code of 16-bit lane 8 j + i of row p and of row p + 1.
  alignas(64) uint8_t pair_rows[2][64];
  // The low (even) and the high (odd) bytes of 64 16-bit lanes in two registers.
  alignas(64) uint8_t even_bytes[64];
  alignas(64) uint8_t odd_bytes[64];
  // 16-bit lane 2 n takes lane n, lane 2 n + 1 lane 16 + n.
  alignas(64) uint16_t interleave[32];
  // The 16 E2M1 values' bfloat16 bits, twice (the 16-bit permute reads five index bits).
  alignas(64) uint16_t e2m1_bf16[32];

  Shuffles() {
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < 8; ++r) quad_to_octet[h][8 * c + r] = uint8_t(16 * r + 8 * h + c);
    for (int c = 0; c < 8; ++c)
      for (int n = 0; n < 16; ++n) {
        const uint8_t source = uint8_t(64 * (n / 8) + 8 * c + n % 8);
        octet_to_lanes[c][4 * n] = octet_to_lanes[c][4 * n + 2] = source;
        octet_to_lanes[c][4 * n + 1] = octet_to_lanes[c][4 * n + 3] = 0;
      }
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < 4; ++r)
          for (int odd = 0; odd < 2; ++odd) pairs_1[h][2 * (4 * c + r) + odd] = uint8_t(32 * r + 16 * h + 2 * c + odd);
    for (int g = 0; g < 2; ++g)
      for (int c = 0; c < 4; ++c)
        for (int r = 0; r < 8; ++r)
          for (int odd = 0; odd < 2; ++odd)
            pairs_2[g][2 * (8 * c + r) + odd] = uint8_t(64 * (r / 4) + 2 * (4 * (4 * g + c) + r % 4) + odd);
    for (int c = 0; c < 4; ++c)
      for (int n = 0; n < 16; ++n)
        for (int odd = 0; odd < 2; ++odd)
          pairs_3[c][4 * n + 2 * odd + 1] = pairs_3[c][4 * n + 2 * odd] =
              uint8_t(64 * (n / 8) + 2 * (8 * c + n % 8) + odd);
    for (int w = 0; w < 2; ++w)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 8; ++i) {
          pair_rows[w][16 * j + i] = pairs_3[2 * w][2 * (8 * j + i)];
          pair_rows[w][16 * j + 8 + i] = pairs_3[2 * w + 1][2 * (8 * j + i)];
        }
    for (int i = 0; i < 64; ++i) {
      even_bytes[i] = uint8_t(2 * i);
      odd_bytes[i] = uint8_t(2 * i + 1);
    }
    for (int n = 0; n < 16; ++n) {
      interleave[2 * n] = uint16_t(n);
      interleave[2 * n + 1] = uint16_t(16 + n);
    }
    static const uint16_t kE2m1[8] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0};
    for (int i = 0; i < 32; ++i) e2m1_bf16[i] = uint16_t(kE2m1[i % 8] | ((i & 8) ? 0x8000 : 0));
  }
};

inline const Shuffles& shuffles() {
  static const Shuffles built;
  return built;
}

TUTEL_AMX_DECODE inline __m512i load64(const uint8_t* p) { return _mm512_load_si512(p); }

// 16 rows' bytes [offset, offset + count) (count <= 16, zero past it) as 4 registers of 4 rows,
// then as 2 x 2 registers: octets[a][h] holds bytes 8 h .. 8 h + 7 of rows 8 a .. 8 a + 7
// (Shuffles::quad_to_octet).  Every row is read: the caller points rows it has not at zeros.
TUTEL_AMX_DECODE inline void fp4_octets(const uint8_t* const* rows, int64_t offset, int count, const Shuffles& sh,
                                        __m512i (&octets)[2][2]) {
  const __mmask16 kept = __mmask16((1u << count) - 1u);
  __m512i quads[4];
  for (int q = 0; q < 4; ++q) {
    __m128i r[4];
    for (int i = 0; i < 4; ++i) {
      const uint8_t* p = rows[4 * q + i] + offset;
      r[i] = count == 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(kept, p);
    }
    quads[q] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(r[0]), r[1], 1), r[2], 2),
                                  r[3], 3);
  }
  for (int a = 0; a < 2; ++a)
    for (int h = 0; h < 2; ++h)
      octets[a][h] = _mm512_permutex2var_epi8(quads[2 * a], load64(sh.quad_to_octet[h]), quads[2 * a + 1]);
}

// Byte c (< 16) of the 16 rows of fp4_octets in the low byte of 32-bit lane n, the rest zero.
TUTEL_AMX_DECODE inline __m512i octet_lanes(const __m512i (&octets)[2][2], int c, const Shuffles& sh) {
  return _mm512_maskz_permutex2var_epi8(__mmask64(0x1111111111111111ull), octets[0][c / 8],
                                        load64(sh.octet_to_lanes[c % 8]), octets[1][c / 8]);
}

// MXFP4: tile row p = the bfloat16 values of code byte p of the 16 rows, each lane's nonzero values
// with `exponent_add` (16-bit lanes: (s - 127) << 7 of the lane's row) added to their bits.
TUTEL_AMX_DECODE inline void mxfp4_step(const uint8_t* const* rows, int64_t offset, const uint32_t* exponent_add,
                                        const Shuffles& sh, PackedTile& out) {
  __m512i octets[2][2];
  fp4_octets(rows, offset, 16, sh, octets);
  const __m512i table = _mm512_load_si512(sh.e2m1_bf16);
  const __m512i high_nibble = _mm512_set1_epi32(4 << 16);  // shift the high 16-bit lane by 4
  const __m512i magnitude = _mm512_set1_epi16(7);
  const __m512i add = _mm512_loadu_si512(exponent_add);
  for (int p = 0; p < 16; ++p) {
    const __m512i bytes = _mm512_maskz_permutex2var_epi8(__mmask64(0x5555555555555555ull), octets[0][p / 8],
                                                         load64(sh.octet_to_lanes[p % 8]), octets[1][p / 8]);
    const __m512i codes = _mm512_srlv_epi16(bytes, high_nibble);
    const __m512i bits = _mm512_permutexvar_epi16(codes, table);
    const __mmask32 nonzero = _mm512_test_epi16_mask(codes, magnitude);
    _mm512_store_si512(out.pairs + 16 * p, _mm512_mask_add_epi16(bits, nonzero, bits, add));
  }
}

// NVFP4: tile row p = the values of code byte p of the 16 rows, times factors[p / 8] (per lane:
// the row's block scale times the global scale), rounded to bfloat16.  `half`: 8 code bytes.
TUTEL_AMX_DECODE inline void nvfp4_step(const uint8_t* const* rows, int64_t offset, bool half, const float* factors,
                                        const Shuffles& sh, PackedTile& out) {
  __m512i octets[2][2];
  fp4_octets(rows, offset, half ? 8 : 16, sh, octets);
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                      -2.0f, -3.0f, -4.0f, -6.0f);
  const __m512i interleave = _mm512_load_si512(sh.interleave);
  const __m512 factor[2] = {_mm512_loadu_ps(factors), _mm512_loadu_ps(factors + 16)};
  for (int p = 0; p < (half ? 8 : 16); ++p) {
    const __m512i bytes = octet_lanes(octets, p, sh);
    const __m512 even = _mm512_mul_ps(_mm512_permutexvar_ps(bytes, table), factor[p / 8]);
    const __m512 odd = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table), factor[p / 8]);
    const __m512i rounded = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    _mm512_store_si512(out.pairs + 16 * p, _mm512_permutexvar_epi16(interleave, rounded));
  }
  if (half)
    for (int p = 8; p < 16; ++p) _mm512_store_si512(out.pairs + 16 * p, _mm512_setzero_si512());
}

// FP8's step (16 rows x `count` <= 32 code bytes from offset, zero past it) transposed in byte
// pairs: with octets[c][h][g] and Shuffles::pairs_3[p % 4], tile row p = rows' code bytes 2 p, 2 p + 1
// come out of octets[.][p / 8][p % 8 / 4].
TUTEL_AMX_DECODE inline void fp8_octets(const uint8_t* const* rows, int64_t offset, int count, const Shuffles& sh,
                                        __m512i (&octets)[2][2][2]) {
  const __mmask32 kept = count >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << count) - 1u);
  __m512i duos[8];
  for (int q = 0; q < 8; ++q) {
    __m256i r[2];
    for (int i = 0; i < 2; ++i) {
      const uint8_t* p = rows[2 * q + i] + offset;
      r[i] = count >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi8(kept, p);
    }
    duos[q] = _mm512_inserti64x4(_mm512_castsi256_si512(r[0]), r[1], 1);
  }
  __m512i quads[4][2];
  for (int a = 0; a < 4; ++a)
    for (int h = 0; h < 2; ++h)
      quads[a][h] = _mm512_permutex2var_epi8(duos[2 * a], load64(sh.pairs_1[h]), duos[2 * a + 1]);
  for (int c = 0; c < 2; ++c)
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 2; ++g)
        octets[c][h][g] = _mm512_permutex2var_epi8(quads[2 * c][h], load64(sh.pairs_2[g]), quads[2 * c + 1][h]);
}

// Tile row p's codes: code bytes 2 p, 2 p + 1 of the 16 rows, each in both bytes of its 16-bit lane.
TUTEL_AMX_DECODE inline __m512i fp8_pair_codes(const __m512i (&octets)[2][2][2], int p, const Shuffles& sh) {
  const int h = p / 8, g = p % 8 / 4;
  return _mm512_permutex2var_epi8(octets[0][h][g], load64(sh.pairs_3[p % 4]), octets[1][h][g]);
}

// The bytes of fp8_table_step's table for scale s: [0, 128) the low and [128, 256) the high bytes of
// bfloat16(E4M3 magnitude c * s) for c = 0..127 (`e4m3`: byte_tables().e4m3).  The products round
// as decode_step's do where s * 256 keeps every nonzero one a normal float (the caller's check).
TUTEL_AMX_DECODE inline void fp8_scaled_table(const float* e4m3, float scale, const Shuffles& sh, uint8_t* bytes) {
  const __m512 s = _mm512_set1_ps(scale);
  __m512i words[4];
  for (int i = 0; i < 4; ++i)
    words[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(e4m3 + 32 * i + 16), s),
                                            _mm512_mul_ps(_mm512_loadu_ps(e4m3 + 32 * i), s));
  for (int h = 0; h < 2; ++h) {
    const __m512i first = words[2 * h], second = words[2 * h + 1];
    _mm512_storeu_si512(bytes + 64 * h, _mm512_permutex2var_epi8(first, load64(sh.even_bytes), second));
    _mm512_storeu_si512(bytes + 128 + 64 * h, _mm512_permutex2var_epi8(first, load64(sh.odd_bytes), second));
  }
}

// FP8 (E4M3), the 16 rows sharing one scale: tile row p = code bytes 2 p, 2 p + 1 of the 16 rows
// (of `count` <= 32 from offset, zero past it) looked up in `table` (fp8_scaled_table), the code's
// sign bit flipping the value's.  Two tile rows at a time: their 64 codes look up their low and
// their high bytes (the byte permutes read seven index bits: the code without its sign), and two
// byte unpacks pair those into the rows' bfloat16 lanes.
TUTEL_AMX_DECODE inline void fp8_table_step(const uint8_t* const* rows, int64_t offset, int count,
                                            const uint8_t* table, const Shuffles& sh, PackedTile& out) {
  __m512i octets[2][2][2];
  fp8_octets(rows, offset, count, sh, octets);
  const __m512i low[2] = {_mm512_loadu_si512(table), _mm512_loadu_si512(table + 64)};
  const __m512i high[2] = {_mm512_loadu_si512(table + 128), _mm512_loadu_si512(table + 192)};
  const __m512i sign = _mm512_set1_epi8(int8_t(0x80));
  for (int p = 0; p < 16; p += 2) {
    const int h = p / 8, g = p % 8 / 4;
    const __m512i codes = _mm512_permutex2var_epi8(octets[0][h][g], load64(sh.pair_rows[p % 4 / 2]), octets[1][h][g]);
    const __m512i lows = _mm512_permutex2var_epi8(low[0], codes, low[1]);
    const __m512i magnitudes = _mm512_permutex2var_epi8(high[0], codes, high[1]);
    const __m512i highs = _mm512_ternarylogic_epi32(magnitudes, codes, sign, 0x78);  // ^ (codes & sign)
    _mm512_store_si512(out.pairs + 16 * p, _mm512_unpacklo_epi8(lows, highs));
    _mm512_store_si512(out.pairs + 16 * (p + 1), _mm512_unpackhi_epi8(lows, highs));
  }
}

// FP8 (E4M3), scales per lane: tile row p = code bytes 2 p, 2 p + 1 of the 16 rows (of `count` <= 32
// from offset, zero past it), times scales[0] (lanes 2 n + odd: row n's scale * 256, rows 0..7) and
// scales[1] (rows 8..15), rounded to bfloat16.
TUTEL_AMX_DECODE inline void fp8_step(const uint8_t* const* rows, int64_t offset, int count, const float* scales,
                                      const Shuffles& sh, PackedTile& out) {
  __m512i octets[2][2][2];
  fp8_octets(rows, offset, count, sh, octets);
  const __m512i sign_exponent_mantissa = _mm512_set1_epi16(int16_t(0xbf80)), all_ones = _mm512_set1_epi16(0x3f80);
  const __m512i nan_bits = _mm512_set1_epi16(0x7e00);
  const __m512 scale[2] = {_mm512_loadu_ps(scales), _mm512_loadu_ps(scales + 16)};
  for (int p = 0; p < 16; ++p) {
    // The code byte in the high half of its 16-bit lane: as in avx512_codes::e4m3_32, shifted right
    // by one with its sign repeated and bit 14 cleared it is the float16 of the value times 2^-8
    // (the mask also clears what the low half's copy leaves in bits 0..6).
    const __m512i halfs = _mm512_and_si512(_mm512_srai_epi16(fp8_pair_codes(octets, p, sh), 1), sign_exponent_mantissa);
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(halfs, all_ones), all_ones);
    const __m512i bits = _mm512_mask_mov_epi16(halfs, nan, nan_bits);
    const __m512 first = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(bits)), scale[0]);
    const __m512 second = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1)), scale[1]);
    _mm512_store_si512(out.pairs + 16 * p, (__m512i)_mm512_cvtne2ps_pbh(second, first));
  }
}

}  // namespace quantized_tile_steps
}  // namespace gemm
}  // namespace tutel
#endif
