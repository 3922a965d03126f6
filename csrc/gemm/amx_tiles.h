// The AMX tile primitives the tile products share (tile_gemm_amx.cpp and the quantized tile
// products, quantized_tiles_amx.cpp): the tile shapes, the packed layouts of A and B tiles, the tile
// configuration and the one loop of tile products over a block of sums.
//
// Every function carries TUTEL_AMX, so the files including this compile with the baseline flags
// and their code runs only after tile_products_available().
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "avx512_lanes.h"
#include "skinny_gemm.h"

#define TUTEL_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,amx-tile,amx-bf16")))

namespace tutel {
namespace gemm {
namespace amx_tiles {

using avx512::transpose_16x16;

// Every tile is 16 rows of 64 bytes: A holds 16 rows x 32 inner values, B 16 interleaved pairs of
// inner values x 16 columns, C 16 x 16 float sums.
constexpr int64_t kTileRows = 16;
constexpr int64_t kInnerStep = 32;  // inner values per tile product
constexpr int64_t kTileBytes = 64;

// One tile of packed values: 16 rows of 64 bytes (token rows or matrix columns, laid out as the
// tile products read them).
struct alignas(64) PackedTile {
  uint32_t pairs[kTileRows * kTileRows];
};

// The layout _tile_loadconfig reads (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1: A, 2-3: B, 4-7: C (sums, C[i][j] = A_i B_j in tile 4 + 2 i + j).
// The configuration is per thread and other code (oneDNN) loads its own, so each parallel chunk
// loads it and releases the tiles when done.
TUTEL_AMX inline void load_tile_config() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.bytes_per_row[i] = kTileBytes;
    config.rows[i] = kTileRows;
  }
  _tile_loadconfig(&config);
}

// 32 inner values of a row from `k`, zero past `inner`.
TUTEL_AMX inline __m512i load_step(const bfloat16* row, int64_t k, int64_t inner) {
  const int64_t n = inner - k;
  if (n >= kInnerStep) return _mm512_loadu_si512(row + k);
  return _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1u), row + k);
}

// Steps of 32 inner values per tile product.
inline int64_t inner_steps(int64_t inner) { return (inner + kInnerStep - 1) / kInnerStep; }

// `count` <= 16 rows from `first_row`, `stride` values apart, one tile per step of 32 inner values
// at out[s * out_stride], rows past `count` and values past `inner` zero: as they are (A tiles), or
// `transposed` (B tiles: the 16 x 16 blocks of value pairs transposed).
TUTEL_AMX inline void pack_tile_rows(const bfloat16* first_row, int64_t stride, int64_t count, int64_t inner,
                              bool transposed, PackedTile* out, int64_t out_stride) {
  for (int64_t s = 0; s < inner_steps(inner); ++s) {
    __m512i r[16];
    for (int64_t i = 0; i < kTileRows; ++i)
      r[i] = i < count ? load_step(first_row + i * stride, s * kInnerStep, inner) : _mm512_setzero_si512();
    if (transposed) transpose_16x16(r);
    for (int64_t i = 0; i < kTileRows; ++i) _mm512_store_si512(out[s * out_stride].pairs + i * kTileRows, r[i]);
  }
}

// Where a block's C tiles start and end: C[i][j] at c[i][j], rows `stride_bytes` apart, starting
// from the sums there when `carried`, else from zero.
struct BlockSums {
  float* c[2][2];
  int64_t stride_bytes;
  bool carried;
};

// What tile_block does between its steps besides the products: nothing, unless a caller has other
// work to spread over them (side()).
struct NoSideWork {
  void operator()() const {}
};

// C[i][j] += sum over steps [0, steps) of A_i B_j, for i < NA, j < NB: the one tile loop of both
// layouts, whose Operands say where step s's tiles are (a(i, s, stride) and b_tile(j, s, stride)).
// side() runs once per step, while the step's products are under way.
template <int NA, int NB, class Operands, class Side = NoSideWork>
TUTEL_AMX void tile_block(const Operands& operands, int64_t steps, const BlockSums& sums, const Side& side = Side()) {
  const int64_t stride = sums.stride_bytes;
  if (sums.carried) {
    _tile_loadd(4, sums.c[0][0], stride);
    if (NB > 1) _tile_loadd(5, sums.c[0][1], stride);
    if (NA > 1) _tile_loadd(6, sums.c[1][0], stride);
    if (NA > 1 && NB > 1) _tile_loadd(7, sums.c[1][1], stride);
  } else {
    _tile_zero(4);
    if (NB > 1) _tile_zero(5);
    if (NA > 1) _tile_zero(6);
    if (NA > 1 && NB > 1) _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    int64_t stride0 = 0, stride1 = 0, stride2 = 0, stride3 = 0;
    _tile_loadd(0, operands.a(0, s, stride0), stride0);
    if (NA > 1) _tile_loadd(1, operands.a(1, s, stride1), stride1);
    _tile_loadd(2, operands.b_tile(0, s, stride2), stride2);
    if (NB > 1) _tile_loadd(3, operands.b_tile(1, s, stride3), stride3);
    _tile_dpbf16ps(4, 0, 2);
    if (NB > 1) _tile_dpbf16ps(5, 0, 3);
    if (NA > 1) _tile_dpbf16ps(6, 1, 2);
    if (NA > 1 && NB > 1) _tile_dpbf16ps(7, 1, 3);
    side();
  }
  _tile_stored(4, sums.c[0][0], stride);
  if (NB > 1) _tile_stored(5, sums.c[0][1], stride);
  if (NA > 1) _tile_stored(6, sums.c[1][0], stride);
  if (NA > 1 && NB > 1) _tile_stored(7, sums.c[1][1], stride);
}

template <class Operands, class Side = NoSideWork>
TUTEL_AMX void run_block(bool two_a, bool two_b, const Operands& operands, int64_t steps, const BlockSums& sums,
                         const Side& side = Side()) {
  if (two_a && two_b) tile_block<2, 2>(operands, steps, sums, side);
  else if (two_a) tile_block<2, 1>(operands, steps, sums, side);
  else if (two_b) tile_block<1, 2>(operands, steps, sums, side);
  else tile_block<1, 1>(operands, steps, sums, side);
}

// Stores the first n <= 16 lanes of `sums` to y, rounded as Scalar<bfloat16>::store rounds.
TUTEL_AMX inline void store_outputs(bfloat16* y, __m512 sums, int64_t n) {
  if (n == kTileRows) {
    avx512::store16(y, sums);
    return;
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sums);
  for (int64_t j = 0; j < n; ++j) y[j] = Scalar<bfloat16>::store(lanes[j]);
}

// The operands of one block for [O, K] matrices packed by pack_matrix_pairs: A = the token rows of
// blocks b + i (packed as they are), B = the matrix tiles t + j.
struct PackedRowsTimesPackedMatrix {
  const PackedTile* rows;
  const PackedTile* matrix;
  int64_t steps, b, tiles, t;

  const void* a(int i, int64_t s, int64_t& stride_bytes) const {
    stride_bytes = kTileBytes;
    return rows[(b + i) * steps + s].pairs;
  }
  const void* b_tile(int j, int64_t s, int64_t& stride_bytes) const {
    stride_bytes = kTileBytes;
    return matrix[tiles * s + t + j].pairs;
  }
};

// Token rows are taken this many blocks of 16 at a time (256 rows, 512 KiB of packed tiles at
// 1024 inner values), so that they stay in the core's second-level cache while each 32 outputs of
// an item pass over them.
constexpr int64_t kPackedSpanBlocks = 16;

// The sums of a span's block pair q: C[i][j] (token tile i, output tile j) at
// sums[q * kSpanSumsBlock + 16 i * kSpanSumsRow + 16 j], rows of 32 floats.
constexpr int64_t kSpanSumsRow = 2 * kTileRows, kSpanSumsDown = kTileRows * kSpanSumsRow;
constexpr int64_t kSpanSumsBlock = 2 * kSpanSumsDown;

// How many tile steps packed_rows_times_packed_matrix runs (each block of up to two row tiles and
// two output tiles takes `steps`; spans are whole pairs of row tiles): side() runs this many times.
inline int64_t packed_product_tile_steps(int64_t steps, int64_t blocks, int64_t tiles) {
  return (tiles + 1) / 2 * ((blocks + 1) / 2) * steps;
}

// Packed token rows (`blocks` tiles of 16 rows, `steps` steps each) times a matrix packed by output
// tiles (`tiles` of them), kPackedSpanBlocks row tiles and two output tiles at a time; after each
// such span, store(b_begin, b_end, t, two_o, sums) writes its sums out (laid out as above).  side()
// runs once per tile step (packed_product_tile_steps).
template <class Store, class Side = NoSideWork>
TUTEL_AMX void packed_rows_times_packed_matrix(const PackedTile* rows, const PackedTile* matrix, int64_t steps,
                                               int64_t blocks, int64_t tiles, Store&& store,
                                               const Side& side = Side()) {
  alignas(64) float sums[kPackedSpanBlocks / 2 * kSpanSumsBlock];
  for (int64_t b_begin = 0; b_begin < blocks; b_begin += kPackedSpanBlocks) {
    const int64_t b_end = std::min(blocks, b_begin + kPackedSpanBlocks);
    for (int64_t t = 0; t < tiles; t += 2) {
      const bool two_o = tiles - t > 1;
      for (int64_t b = b_begin; b < b_end; b += 2) {
        float* const c = sums + (b - b_begin) / 2 * kSpanSumsBlock;
        const BlockSums block_sums{{{c, c + kTileRows}, {c + kSpanSumsDown, c + kSpanSumsDown + kTileRows}},
                                   kSpanSumsRow * int64_t(sizeof(float)), false};
        run_block(b_end - b > 1, two_o, PackedRowsTimesPackedMatrix{rows, matrix, steps, b, tiles, t}, steps,
                  block_sums, side);
      }
      store(b_begin, b_end, t, two_o, static_cast<const float*>(sums));
    }
  }
}

// Token row r's 32 sums of a span that starts at row tile b_begin (see packed_rows_times_packed_matrix).
inline const float* span_row_sums(const float* sums, int64_t b_begin, int64_t r) {
  return sums + (r / (2 * kTileRows) - b_begin / 2) * kSpanSumsBlock + r % (2 * kTileRows) * kSpanSumsRow;
}

}  // namespace amx_tiles
}  // namespace gemm
}  // namespace tutel

#endif
