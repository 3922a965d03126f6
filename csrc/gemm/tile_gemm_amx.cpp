// AMX tile products (tile_gemm.h).  Every function that touches tiles or 512-bit registers carries
// TUTEL_AMX, so this file compiles with the baseline flags and its code runs only after
// tile_products_available().
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its (maybe-)uninitialized warnings
// flag at every inlined use; this file holds nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "tile_gemm.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "../core/parallel.h"
#include "work_balance.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"

namespace tutel {
namespace gemm {

using core::max_parallelism;
using core::parallel_for;
using namespace amx_tiles;
namespace {


// Token rows [16 b, 16 b + 16) of `p`, one tile per step, rows past p.rows zero (pack_tile_rows):
// transposed as B tiles, or as they are as A tiles.
TUTEL_AMX void pack_rows(const SkinnyProduct<bfloat16>& p, int64_t block, int64_t inner, bool transposed,
                         PackedTile* out) {
  const int64_t first = block * kTileRows;
  pack_tile_rows(p.x + first * p.x_stride, p.x_stride, std::min(kTileRows, p.rows - first), inner, transposed, out,
                 1);
}

// Steps [s_begin, s_end) of [K, O] matrix columns [o_begin, o_end) as B tiles: for step s the
// tiles of columns o_begin + 16 j, .. sit at chunk[(s - s_begin) * tiles_per_step + j], each tile
// row holding the pairs (W[k][c], W[k + 1][c]).  Columns past o_end and rows past `inner` are
// zero.  Each pair of matrix rows is read across all the columns in turn, in 64-byte pieces.
TUTEL_AMX void pack_matrix_chunk(const SkinnyProduct<bfloat16>& p, int64_t o_begin, int64_t o_end, int64_t inner,
                                 int64_t s_begin, int64_t s_end, int64_t tiles_per_step, PackedTile* chunk) {
  // Lane 2 c of the first tile's row: W[k][c], lane 2 c + 1: W[k + 1][c] (index 32 + c picks from
  // the second operand); the second tile the same from column 16.
  alignas(64) static const uint16_t kFirst[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                  8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i first = _mm512_load_si512(kFirst);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  for (int64_t s = s_begin; s < s_end; ++s) {
    PackedTile* step = chunk + (s - s_begin) * tiles_per_step;
    for (int64_t pair = 0; pair < kTileRows; ++pair) {
      const int64_t k = s * kInnerStep + 2 * pair;
      const bfloat16* even_row = p.w + k * p.w_stride;
      const bfloat16* odd_row = even_row + p.w_stride;
      for (int64_t o = o_begin, j = 0; o < o_end; o += 2 * kTileRows, j += 2) {
        const __mmask32 valid = __mmask32((uint64_t(1) << std::min(2 * kTileRows, o_end - o)) - 1u);
        const __m512i even = k < inner ? _mm512_maskz_loadu_epi16(valid, even_row + o) : _mm512_setzero_si512();
        const __m512i odd = k + 1 < inner ? _mm512_maskz_loadu_epi16(valid, odd_row + o) : _mm512_setzero_si512();
        _mm512_store_si512(step[j].pairs + pair * kTileRows, _mm512_permutex2var_epi16(even, first, odd));
        if (j + 1 < tiles_per_step)
          _mm512_store_si512(step[j + 1].pairs + pair * kTileRows, _mm512_permutex2var_epi16(even, second, odd));
      }
    }
  }
}

// The operands of one block for [O, K] matrices: A = matrix rows [o + 16 i, +16) straight from
// memory when all 16 rows and 32 values exist (else copied with zeros into `spare`), B = the
// packed token rows of blocks b + j.
struct MatrixRowsTimesPackedRows {
  const SkinnyProduct<bfloat16>& p;
  const PackedTile* rows;
  int64_t steps, inner, outputs, o, b;
  bfloat16* spare;  // 2 x 16 x 32, 64-byte aligned

  TUTEL_AMX const void* a(int i, int64_t s, int64_t& stride_bytes) const {
    const int64_t first = o + i * kTileRows, k = s * kInnerStep;
    const int64_t count = std::min(kTileRows, outputs - first);
    if (count == kTileRows && k + kInnerStep <= inner) {
      stride_bytes = p.w_stride * int64_t(sizeof(bfloat16));
      return p.w + first * p.w_stride + k;
    }
    bfloat16* copy = spare + i * kTileRows * kInnerStep;
    for (int64_t r = 0; r < kTileRows; ++r) {
      const __m512i v = r < count ? load_step(p.w + (first + r) * p.w_stride, k, inner) : _mm512_setzero_si512();
      _mm512_store_si512(copy + r * kInnerStep, v);
    }
    stride_bytes = kTileBytes;
    return copy;
  }
  const void* b_tile(int j, int64_t s, int64_t& stride_bytes) const {
    stride_bytes = kTileBytes;
    return rows[(b + j) * steps + s].pairs;
  }
};


// The bias of outputs [o, o + n), n <= 16, as floats (zero without a bias).
TUTEL_AMX inline __m512 load_bias(const bfloat16* bias, int64_t o, int64_t n) {
  if (!bias) return _mm512_setzero_ps();
  return avx512::widen_bf16(_mm256_maskz_loadu_epi16(__mmask16((uint32_t(1) << n) - 1u), bias + o));
}


// Writes one 16 x 16 block of `sums` (matrix rows [o, o + 16) from row `a` of it, token rows
// [t, t + 16) from column `c`) to y, transposed, plus bias: outputs [o, o_end), token rows below
// p.rows.
TUTEL_AMX void write_transposed_block(const SkinnyProduct<bfloat16>& p, const float* sums, int64_t a, int64_t c,
                                      int64_t o, int64_t o_end, int64_t t) {
  const int64_t n = std::min(kTileRows, o_end - o), rows = std::min(kTileRows, p.rows - t);
  if (n <= 0 || rows <= 0) return;
  __m512i r[16];
  for (int64_t i = 0; i < kTileRows; ++i) r[i] = _mm512_load_si512(sums + (a + i) * 2 * kTileRows + c);
  transpose_16x16(r);
  const __m512 bias = load_bias(p.bias, o, n);
  for (int64_t i = 0; i < rows; ++i)
    store_outputs(p.y + (t + i) * p.y_stride + o, _mm512_add_ps(_mm512_castsi512_ps(r[i]), bias), n);
}

// [O, K] matrices: outputs [o_begin, o_end) of product p, whose token rows are packed as B tiles
// in `rows`; `spare` holds 2 x 16 x 32 values of scratch.
TUTEL_AMX void outputs_by_inner(const SkinnyProduct<bfloat16>& p, const PackedTile* rows, int64_t inner,
                                int64_t outputs, int64_t o_begin, int64_t o_end, bfloat16* spare) {
  // C[i][j] (output tile i, token tile j) at sums[16 i][16 j] of a [32][32] block.
  alignas(64) float sums[2 * kTileRows * 2 * kTileRows];
  constexpr int64_t kRow = 2 * kTileRows, kDown = kTileRows * kRow;
  const BlockSums block_sums{{{sums, sums + kTileRows}, {sums + kDown, sums + kDown + kTileRows}},
                             kRow * int64_t(sizeof(float)), false};
  const int64_t steps = inner_steps(inner);
  const int64_t blocks = (p.rows + kTileRows - 1) / kTileRows;
  for (int64_t o = o_begin; o < o_end; o += 2 * kTileRows) {
    const bool two_o = o_end - o > kTileRows;
    for (int64_t b = 0; b < blocks; b += 2) {
      const bool two_t = blocks - b > 1;
      run_block(two_o, two_t, MatrixRowsTimesPackedRows{p, rows, steps, inner, outputs, o, b, spare}, steps,
                block_sums);
      for (int64_t i = 0; i < (two_o ? 2 : 1); ++i)
        for (int64_t j = 0; j < (two_t ? 2 : 1); ++j)
          write_transposed_block(p, sums, i * kTileRows, j * kTileRows, o + i * kTileRows, o_end, (b + j) * kTileRows);
    }
  }
}

// Matrix rows [o, o + 16 * tiles) of p (zero from `o_end` and past `inner`) as B tiles, step after
// step: out[tiles * s + t] pairs inner values (k, k + 1) of step s for rows [o + 16 t, +16).
TUTEL_AMX void pack_matrix_pairs(const SkinnyProduct<bfloat16>& p, int64_t o, int64_t o_end, int64_t tiles,
                                 int64_t inner, PackedTile* out) {
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first = o + t * kTileRows;
    pack_tile_rows(p.w + first * p.w_stride, p.w_stride, std::min(kTileRows, o_end - first), inner, true, out + t,
                   tiles);
  }
}


// [O, K] matrices of many token rows: outputs [o_begin, o_end) of product p, whose token rows are
// packed as A tiles in `rows`; `matrix` holds steps x (o_end - o_begin) / 16 tiles of scratch.
// The item's matrix rows are packed as B tiles first, once, so that the sums come out as token
// rows: written without the transposition outputs_by_inner needs, which at 256 inner values took
// as long as the tile products.
TUTEL_AMX void outputs_by_inner_packed(const SkinnyProduct<bfloat16>& p, const PackedTile* rows, int64_t inner,
                                       int64_t o_begin, int64_t o_end, PackedTile* matrix) {
  const int64_t steps = inner_steps(inner);
  const int64_t blocks = (p.rows + kTileRows - 1) / kTileRows;
  const int64_t tiles = (o_end - o_begin + kTileRows - 1) / kTileRows;
  pack_matrix_pairs(p, o_begin, o_end, tiles, inner, matrix);
  const auto store = [&](int64_t b_begin, int64_t b_end, int64_t t, bool two_o, const float* sums) TUTEL_AMX {
    // Each token row's 32 outputs from its row of the block's sums, plus bias.
    const int64_t o = o_begin + t * kTileRows;
    const int64_t n0 = std::min(kTileRows, o_end - o), n1 = std::min(kTileRows, o_end - o - kTileRows);
    const __m512 bias0 = load_bias(p.bias, o, n0);
    const __m512 bias1 = two_o ? load_bias(p.bias, o + kTileRows, n1) : _mm512_setzero_ps();
    const int64_t last = std::min(b_end * kTileRows, p.rows);
    for (int64_t r = b_begin * kTileRows; r < last; ++r) {
      const float* const c = span_row_sums(sums, b_begin, r);
      bfloat16* const y = p.y + r * p.y_stride + o;
      store_outputs(y, _mm512_add_ps(_mm512_load_ps(c), bias0), n0);
      if (two_o) store_outputs(y + kTileRows, _mm512_add_ps(_mm512_load_ps(c + kTileRows), bias1), n1);
    }
  };
  packed_rows_times_packed_matrix(rows, matrix, steps, blocks, tiles, store);
}

// [K, O] matrices are read in chunks of matrix rows across all of a work item's columns (whole
// rows where the items allow), so that memory streams; a chunk holds at most this many tiles.
constexpr int64_t kChunkTiles = 256;

// Steps per chunk for items `tiles` output tiles wide: 1..16.
inline int64_t chunk_steps(int64_t tiles) { return std::max<int64_t>(1, std::min<int64_t>(16, kChunkTiles / tiles)); }

// The operands of one block for [K, O] matrices, over one chunk's steps: A = the packed token rows
// of blocks b + i at step s_begin + s, B = the chunk's output tiles t_o + j at its step s.
struct PackedRowsTimesChunk {
  const PackedTile* rows;
  int64_t steps, b, s_begin;
  const PackedTile* chunk;
  int64_t tiles, t_o;

  const void* a(int i, int64_t s, int64_t& stride_bytes) const {
    stride_bytes = kTileBytes;
    return rows[(b + i) * steps + s_begin + s].pairs;
  }
  const void* b_tile(int j, int64_t s, int64_t& stride_bytes) const {
    stride_bytes = kTileBytes;
    return chunk[s * tiles + t_o + j].pairs;
  }
};

// [K, O] matrices: outputs [o_begin, o_end) of product p, whose token rows are packed as A tiles in
// `rows`.  `chunk` holds chunk_steps x (o_end - o_begin) / 16 tiles and `carried` one tile per
// (token block, output tile) of scratch.
TUTEL_AMX void inner_by_outputs(const SkinnyProduct<bfloat16>& p, const PackedTile* rows, int64_t inner,
                                int64_t o_begin, int64_t o_end, PackedTile* chunk, float* carried) {
  const int64_t steps = inner_steps(inner);
  const int64_t blocks = (p.rows + kTileRows - 1) / kTileRows;
  const int64_t tiles = (o_end - o_begin + kTileRows - 1) / kTileRows, per_chunk = chunk_steps(tiles);
  // One pass even without inner values, so that the sums start from zero.
  for (int64_t s_begin = 0; s_begin == 0 || s_begin < steps; s_begin += per_chunk) {
    const int64_t s_end = std::min(steps, s_begin + per_chunk);
    pack_matrix_chunk(p, o_begin, o_end, inner, s_begin, s_end, tiles, chunk);
    for (int64_t t_o = 0; t_o < tiles; t_o += 2) {
      const bool two_o = tiles - t_o > 1;
      for (int64_t b = 0; b < blocks; b += 2) {
        const bool two_t = blocks - b > 1;
        // C[i][j] (token block b + i, output tile t_o + j) carried in its own tile of `carried`.
        float* const c = carried + (b * tiles + t_o) * kTileRows * kTileRows;
        float* const below = c + tiles * kTileRows * kTileRows;
        const BlockSums sums{{{c, c + kTileRows * kTileRows}, {below, below + kTileRows * kTileRows}}, kTileBytes,
                             s_begin > 0};
        run_block(two_t, two_o, PackedRowsTimesChunk{rows, steps, b, s_begin, chunk, tiles, t_o}, s_end - s_begin,
                  sums);
      }
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t t_o = 0; t_o < tiles; ++t_o) {
      const int64_t o = o_begin + t_o * kTileRows, n = std::min(kTileRows, o_end - o);
      const __m512 bias = load_bias(p.bias, o, n);
      const float* sums = carried + (b * tiles + t_o) * kTileRows * kTileRows;
      for (int64_t r = 0; r < std::min(kTileRows, p.rows - b * kTileRows); ++r)
        store_outputs(p.y + (b * kTileRows + r) * p.y_stride + o,
                      _mm512_add_ps(_mm512_load_ps(sums + r * kTileRows), bias), n);
    }
  }
}

// [K, O] matrices of few token rows, read in place: B tiles straight from the matrix, without
// interleaving its rows.  A B tile row of 32 matrix values W[k][o .. o + 32) pairs
// (W[k][o + 2 n], W[k][o + 2 n + 1]) where the products want (W[k][c], W[k + 1][c]); so the token
// rows come "spread" instead: A_even's row r holds (x[r][k], 0, x[r][k + 1], 0, ...) and A_odd's
// (0, x[r][k], 0, x[r][k + 1], ...), and A_even B sums the even columns of the 32, A_odd B the odd
// ones, 16 inner values per step.  That is twice the tile products of interleaving, which for one
// block of 16 token rows still run in the time the matrix takes to arrive; interleaving had to
// stream every value through registers first (see inner_by_outputs).
constexpr int64_t kSpreadStep = 16;  // inner values per spread step

inline int64_t spread_steps(int64_t inner) { return (inner + kSpreadStep - 1) / kSpreadStep; }

// Token rows [16 b, 16 b + 16) of `p` as spread A tiles: out[2 s] = A_even, out[2 s + 1] = A_odd
// of step s; rows past p.rows and values past `inner` zero.
TUTEL_AMX void pack_spread_rows(const SkinnyProduct<bfloat16>& p, int64_t block, int64_t inner, PackedTile* out) {
  const int64_t first = block * kTileRows, count = std::min(kTileRows, p.rows - first);
  for (int64_t s = 0; s < spread_steps(inner); ++s) {
    const int64_t k = s * kSpreadStep;
    const __mmask16 valid = __mmask16((uint32_t(1) << std::min(kSpreadStep, inner - k)) - 1u);
    for (int64_t i = 0; i < kTileRows; ++i) {
      // bfloat16 x in the low half of each 32-bit lane (A_even), then in the high half (A_odd).
      const __m512i even =
          i < count ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, p.x + (first + i) * p.x_stride + k))
                    : _mm512_setzero_si512();
      _mm512_store_si512(out[2 * s].pairs + i * kTileRows, even);
      _mm512_store_si512(out[2 * s + 1].pairs + i * kTileRows, _mm512_slli_epi32(even, 16));
    }
  }
}

// The B tile of matrix rows [16 s, 16 s + 16) x columns [o, o + 32): the matrix itself where all
// exist, else a copy with zeros in `spare` (16 x 32 values, 64-byte aligned); its row stride in
// `stride_bytes`.
TUTEL_AMX inline const void* matrix_tile(const SkinnyProduct<bfloat16>& p, int64_t inner, int64_t o_end, int64_t s,
                                         int64_t o, bfloat16* spare, int64_t& stride_bytes) {
  const int64_t k = s * kSpreadStep;
  const int64_t rows = std::min(kSpreadStep, inner - k), columns = std::min(2 * kTileRows, o_end - o);
  const bfloat16* at = p.w + k * p.w_stride + o;
  if (rows == kSpreadStep && columns == 2 * kTileRows) {
    stride_bytes = p.w_stride * int64_t(sizeof(bfloat16));
    return at;
  }
  const __mmask32 valid = __mmask32((uint64_t(1) << columns) - 1u);
  for (int64_t r = 0; r < kSpreadStep; ++r) {
    const __m512i v = r < rows ? _mm512_maskz_loadu_epi16(valid, at + r * p.w_stride) : _mm512_setzero_si512();
    _mm512_store_si512(spare + r * 2 * kTileRows, v);
  }
  stride_bytes = kTileBytes;
  return spare;
}

// Matrix rows are read this many steps (x 16) at a time across all of an item's columns, each
// (token block, 64 columns) keeping its sums in tiles over the chunk and in memory between chunks.
// One step passes the sums through memory every step; 64 matrix rows read side by side still
// stream, 128 outrun the prefetchers (docs/performance.md, "Tile products on AMX").
constexpr int64_t kInPlaceChunkSteps = 4;

// [K, O] matrices read in place: outputs [o_begin, o_end) of product p, whose token rows are
// spread in `spread` (pack_spread_rows, block after block); `carried` holds 2 tiles per (token
// block, 32 outputs) of scratch, `spare` 2 x 16 x 32 values.
TUTEL_AMX void inner_by_outputs_in_place(const SkinnyProduct<bfloat16>& p, const PackedTile* spread, int64_t inner,
                                         int64_t o_begin, int64_t o_end, bfloat16* spare, float* carried) {
  constexpr int64_t kTile = kTileRows * kTileRows;
  const int64_t steps = spread_steps(inner), blocks = (p.rows + kTileRows - 1) / kTileRows;
  const int64_t tiles = (o_end - o_begin + 2 * kTileRows - 1) / (2 * kTileRows);  // of 32 outputs
  // Tiles 0-1: A_even, A_odd; 2-3: B of columns o, o + 32; 4-5 and 6-7: their even and odd sums.
  // One pass even without inner values, so that the sums start from zero.
  for (int64_t s_begin = 0; s_begin == 0 || s_begin < steps; s_begin += kInPlaceChunkSteps) {
    const int64_t s_end = std::min(steps, s_begin + kInPlaceChunkSteps);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t t = 0; t < tiles; t += 2) {
        const int64_t o = o_begin + t * 2 * kTileRows;
        const bool two = t + 1 < tiles;
        float* const c = carried + (b * tiles + t) * 2 * kTile;  // even, odd sums of tile t, then of t + 1
        if (s_begin == 0) {
          _tile_zero(4);
          _tile_zero(5);
          if (two) _tile_zero(6);
          if (two) _tile_zero(7);
        } else {
          _tile_loadd(4, c, kTileBytes);
          _tile_loadd(5, c + kTile, kTileBytes);
          if (two) _tile_loadd(6, c + 2 * kTile, kTileBytes);
          if (two) _tile_loadd(7, c + 3 * kTile, kTileBytes);
        }
        for (int64_t s = s_begin; s < s_end; ++s) {
          int64_t stride0 = 0, stride1 = 0;
          _tile_loadd(0, spread[(b * steps + s) * 2].pairs, kTileBytes);
          _tile_loadd(1, spread[(b * steps + s) * 2 + 1].pairs, kTileBytes);
          _tile_loadd(2, matrix_tile(p, inner, o_end, s, o, spare, stride0), stride0);
          if (two) {
            const void* next = matrix_tile(p, inner, o_end, s, o + 2 * kTileRows, spare + kSpreadStep * 2 * kTileRows,
                                           stride1);
            _tile_loadd(3, next, stride1);
          }
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(5, 1, 2);
          if (two) _tile_dpbf16ps(6, 0, 3);
          if (two) _tile_dpbf16ps(7, 1, 3);
        }
        _tile_stored(4, c, kTileBytes);
        _tile_stored(5, c + kTile, kTileBytes);
        if (two) _tile_stored(6, c + 2 * kTile, kTileBytes);
        if (two) _tile_stored(7, c + 3 * kTile, kTileBytes);
      }
    }
  }
  // Output 2 n of a tile's 32 from lane n of its even sums, 2 n + 1 from lane n of the odd ones
  // (index 16 + n of the pair).
  alignas(64) static const int32_t kLow[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t rows = std::min(kTileRows, p.rows - b * kTileRows);
    for (int64_t t = 0; t < tiles; ++t) {
      const float* const c = carried + (b * tiles + t) * 2 * kTile;
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t first = o_begin + t * 2 * kTileRows + half * kTileRows, n = std::min(kTileRows, o_end - first);
        if (n <= 0) continue;
        const __m512 bias = load_bias(p.bias, first, n);
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 lanes = _mm512_permutex2var_ps(_mm512_load_ps(c + r * kTileRows), half ? high : low,
                                                      _mm512_load_ps(c + kTile + r * kTileRows));
          store_outputs(p.y + (b * kTileRows + r) * p.y_stride + first, _mm512_add_ps(lanes, bias), n);
        }
      }
    }
  }
}

// How one product runs: [O, K] matrices as A tiles straight from memory (outputs_by_inner) or
// packed as B tiles (outputs_by_inner_packed); [K, O] matrices interleaved into B tiles
// (inner_by_outputs) or read in place (inner_by_outputs_in_place).
enum class TileMode { kMatrixRowsAsA, kMatrixPacked, kInterleaved, kInPlace };

// [O, K] products of at least this many token rows pack the matrix: one more pass over it, which
// from 8 blocks of token rows on costs less than the transposed sums of the in-place way (and its
// A tiles, 16 rows a whole matrix row apart, read from the second-level cache for every block).
// With 256-512 inner values the packed way ran faster from 192 token rows (alike at 128), with
// 1024 the two ways were within the noise (docs/performance.md, "Tile products on AMX").
constexpr int64_t kMatrixPackedMinRows = 128;

// [K, O] products of up to this many token rows (one block) read the matrix in place: with a
// second block its tiles come from the cache a second time, through twice the tile products, and
// interleaving caught up.  Up to one block the in-place reading was faster on every shape measured
// (docs/performance.md, "Tile products on AMX").
constexpr int64_t kInPlaceMaxRows = 16;

TileMode tile_mode(WeightLayout layout, int64_t rows) {
  if (layout == WeightLayout::kOutputsByInner)
    return rows >= kMatrixPackedMinRows ? TileMode::kMatrixPacked : TileMode::kMatrixRowsAsA;
  return rows <= kInPlaceMaxRows ? TileMode::kInPlace : TileMode::kInterleaved;
}

// Packed tiles per block of 16 token rows.
int64_t tiles_per_block(TileMode mode, int64_t inner) {
  return mode == TileMode::kInPlace ? 2 * spread_steps(inner) : inner_steps(inner);
}

// Work items: (product, range of outputs).  [O, K] matrices: 64 outputs (their rows are read whole
// whatever the range).  [K, O] matrices: the widest multiple of 32 outputs that still gives every
// thread an item among the `products` of the same mode, so that their rows are read whole once
// there are as many products as threads; interleaved up to 1024 outputs: wider items leave a chunk
// too few steps (kChunkTiles) and pass the sums through memory after each.  In place, whole rows
// stream best (docs/performance.md, "Tile products on AMX").
constexpr int64_t kOutputsPerItem = 64;
constexpr int64_t kMaxInterleavedItemOutputs = 1024;

int64_t outputs_per_item(TileMode mode, int64_t products, int64_t outputs) {
  if (mode == TileMode::kMatrixRowsAsA || mode == TileMode::kMatrixPacked) return kOutputsPerItem;
  const int64_t per_product = std::max<int64_t>(1, (max_parallelism() + products - 1) / std::max<int64_t>(1, products));
  const int64_t width = (outputs + per_product - 1) / per_product;
  const int64_t pairs = (width + 2 * kTileRows - 1) / (2 * kTileRows);  // of 16-output tiles
  const int64_t rounded = std::max<int64_t>(1, pairs) * 2 * kTileRows;
  return mode == TileMode::kInterleaved ? std::min(kMaxInterleavedItemOutputs, rounded) : rounded;
}

struct TileItem {
  int64_t product, o_begin, o_end;
};

struct TileWork {
  const std::vector<SkinnyProduct<bfloat16>>& products;
  const std::vector<TileMode>& modes;         // per product
  const std::vector<int64_t>& first_tile;     // per product: index of its first packed tile
  const std::vector<TileItem>& items;         // in the order the threads claim them
  const PackedTile* packed;
  int64_t inner, outputs;
  size_t chunk_tiles, carried_tiles;  // [K, O] scratch per thread
  size_t matrix_tiles;                // packed [O, K] matrix rows per thread
};

// Runs the items this thread claims from `queue` until none is left.
TUTEL_AMX void run_items(const TileWork& work, WorkQueue& queue) {
  load_tile_config();
  alignas(64) bfloat16 spare[2 * kTileRows * kInnerStep];
  // Scratch of the [K, O] and packed [O, K] products, kept per thread between calls (hundreds of
  // KiB, faulted in once).
  static thread_local std::vector<PackedTile> chunk, carried, matrix;
  if (chunk.size() < work.chunk_tiles) chunk.resize(work.chunk_tiles);
  if (matrix.size() < work.matrix_tiles) matrix.resize(work.matrix_tiles);
  if (carried.size() < work.carried_tiles) carried.resize(work.carried_tiles);
  float* const sums = reinterpret_cast<float*>(carried.data());
  for (int64_t claimed = queue.claim(); claimed >= 0; claimed = queue.claim()) {
    const TileItem& item = work.items[size_t(claimed)];
    const SkinnyProduct<bfloat16>& p = work.products[size_t(item.product)];
    const PackedTile* rows = work.packed + work.first_tile[size_t(item.product)];
    switch (work.modes[size_t(item.product)]) {
      case TileMode::kMatrixRowsAsA:
        outputs_by_inner(p, rows, work.inner, work.outputs, item.o_begin, item.o_end, spare);
        break;
      case TileMode::kMatrixPacked:
        outputs_by_inner_packed(p, rows, work.inner, item.o_begin, item.o_end, matrix.data());
        break;
      case TileMode::kInterleaved:
        inner_by_outputs(p, rows, work.inner, item.o_begin, item.o_end, chunk.data(), sums);
        break;
      case TileMode::kInPlace:
        inner_by_outputs_in_place(p, rows, work.inner, item.o_begin, item.o_end, spare, sums);
        break;
    }
  }
  _tile_release();
}

bool os_grants_tile_data() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

}  // namespace

bool tile_products_available() {
  static const bool available = avx512::cpu_has_avx512() && __builtin_cpu_supports("amx-tile") &&
                                __builtin_cpu_supports("amx-bf16") && os_grants_tile_data();
  return available;
}

void tile_products(const std::vector<SkinnyProduct<bfloat16>>& products, int64_t inner, int64_t outputs,
                   WeightLayout layout) {
  if (products.empty() || outputs <= 0) return;
  std::vector<TileMode> modes;
  std::vector<double> rows;
  int64_t in_place = 0;
  for (const SkinnyProduct<bfloat16>& p : products) {
    modes.push_back(tile_mode(layout, p.rows));
    rows.push_back(double(p.rows));
    in_place += modes.back() == TileMode::kInPlace;
  }
  // Every product's token rows packed once, up front, by every thread: (product, block of 16 rows).
  std::vector<int64_t> first_tile(products.size() + 1, 0);
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (size_t i = 0; i < products.size(); ++i) {
    const int64_t count = (products[i].rows + kTileRows - 1) / kTileRows;
    for (int64_t b = 0; b < count; ++b) blocks.push_back({int64_t(i), b});
    first_tile[i + 1] = first_tile[i] + count * tiles_per_block(modes[i], inner);
  }
  // Kept per calling thread between calls, as the grouped operator's other buffers are: as large
  // as the largest call's token rows.
  static thread_local std::vector<PackedTile> packed;
  if (packed.size() < size_t(first_tile.back())) packed.resize(size_t(first_tile.back()));
  PackedTile* const tiles = packed.data();
  parallel_for(0, int64_t(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [index, block] = blocks[i];
      PackedTile* const out = tiles + first_tile[index] + block * tiles_per_block(modes[index], inner);
      if (modes[index] == TileMode::kInPlace) {
        pack_spread_rows(products[index], block, inner, out);
      } else {
        // B tiles for the in-place [O, K] products, A tiles for the packed ones and for [K, O].
        pack_rows(products[index], block, inner, modes[index] == TileMode::kMatrixRowsAsA, out);
      }
    }
  });
  // The items, those of the products with the most rows first (an item's time follows its
  // product's rows, which differ from expert to expert), each product's together; the threads
  // claim them as they finish the last.  With them the [K, O] scratch the largest item needs:
  // sums for each (token block, 16 outputs) and, interleaving, a chunk of the matrix.
  std::vector<TileItem> items;
  size_t chunk_tiles = 0, carried_tiles = 0, matrix_tiles = 0;
  for (int64_t g : longest_first(rows)) {
    const TileMode mode = modes[size_t(g)];
    const int64_t count = mode == TileMode::kInPlace ? in_place : int64_t(products.size()) - in_place;
    const int64_t width = outputs_per_item(mode, count, outputs);
    for (int64_t o = 0; o < outputs; o += width) items.push_back({g, o, std::min(outputs, o + width)});
    if (mode == TileMode::kMatrixPacked)
      matrix_tiles = std::max(matrix_tiles, size_t((width + kTileRows - 1) / kTileRows * inner_steps(inner)));
    if (mode == TileMode::kMatrixRowsAsA || mode == TileMode::kMatrixPacked) continue;
    const int64_t token_blocks = (products[size_t(g)].rows + kTileRows - 1) / kTileRows;
    const int64_t output_tiles = (width + 2 * kTileRows - 1) / (2 * kTileRows) * 2;
    carried_tiles = std::max(carried_tiles, size_t(token_blocks * output_tiles));
    // An interleaved item's chunk holds chunk_steps(t) x t <= max(kChunkTiles, t) tiles.
    if (mode == TileMode::kInterleaved)
      chunk_tiles = std::max(chunk_tiles, size_t(std::max(kChunkTiles, output_tiles)));
  }
  const TileWork work{products, modes, first_tile, items, tiles, inner, outputs, chunk_tiles, carried_tiles,
                      matrix_tiles};
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), int64_t(0));
  WorkQueue queue(std::move(order));
  parallel_for(0, max_parallelism(), 1, [&](int64_t, int64_t) { run_items(work, queue); });
}

}  // namespace gemm
}  // namespace tutel

#else

namespace tutel {
namespace gemm {

bool tile_products_available() { return false; }

void tile_products(const std::vector<SkinnyProduct<bfloat16>>&, int64_t, int64_t, WeightLayout) {}

}  // namespace gemm
}  // namespace tutel

#endif
