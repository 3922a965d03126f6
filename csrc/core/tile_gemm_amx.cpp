// AMX tile products (tile_gemm.h).  Every function that touches tiles or 512-bit registers carries
// TUTEL_AMX, so this file compiles with the baseline flags and its code runs only after
// tile_products_available().
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its (maybe-)uninitialized warnings
// flag at every inlined use; this file holds nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "tile_gemm.h"

#include <algorithm>
#include <utility>

#include "parallel.h"
#include "work_balance.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx512_lanes.h"

#define TUTEL_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,amx-tile,amx-bf16")))

namespace tutel {
namespace core {
namespace {

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
TUTEL_AMX void load_tile_config() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.bytes_per_row[i] = kTileBytes;
    config.rows[i] = kTileRows;
  }
  _tile_loadconfig(&config);
}

// Transposes a 16 x 16 block of 32-bit lanes held as 16 rows.
TUTEL_AMX inline void transpose_16x16(__m512i r[16]) {
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

// 32 inner values of a row from `k`, zero past `inner`.
TUTEL_AMX inline __m512i load_step(const bfloat16* row, int64_t k, int64_t inner) {
  const int64_t n = inner - k;
  if (n >= kInnerStep) return _mm512_loadu_si512(row + k);
  return _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1u), row + k);
}

// Token rows [16 b, 16 b + 16) of `p`, one tile per step of 32 inner values, rows past p.rows and
// values past `inner` zero: for [O, K] matrices as B tiles (the 16 x 16 blocks of value pairs
// transposed), for [K, O] as A tiles (the rows as they are).
TUTEL_AMX void pack_rows(const SkinnyProduct<bfloat16>& p, int64_t block, int64_t inner, WeightLayout layout,
                         PackedTile* out) {
  const int64_t steps = (inner + kInnerStep - 1) / kInnerStep;
  const int64_t first = block * kTileRows, count = std::min(kTileRows, p.rows - first);
  for (int64_t s = 0; s < steps; ++s) {
    __m512i r[16];
    for (int64_t i = 0; i < kTileRows; ++i)
      r[i] = i < count ? load_step(p.x + (first + i) * p.x_stride, s * kInnerStep, inner) : _mm512_setzero_si512();
    if (layout == WeightLayout::kOutputsByInner) transpose_16x16(r);
    for (int64_t i = 0; i < kTileRows; ++i) _mm512_store_si512(out[s].pairs + i * kTileRows, r[i]);
  }
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
  const void* b_tile(int j, int64_t s) const { return rows[(b + j) * steps + s].pairs; }
};

// Where a block's C tiles start and end: C[i][j] at c[i][j], rows `stride_bytes` apart, starting
// from the sums there when `carried`, else from zero.
struct BlockSums {
  float* c[2][2];
  int64_t stride_bytes;
  bool carried;
};

// C[i][j] += sum over steps [0, steps) of A_i B_j, for i < NA, j < NB: the one tile loop of both
// layouts, whose Operands say where step s's tiles are (a(i, s, stride) and b_tile(j, s)).
template <int NA, int NB, class Operands>
TUTEL_AMX void tile_block(const Operands& operands, int64_t steps, const BlockSums& sums) {
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
    int64_t stride0 = 0, stride1 = 0;
    _tile_loadd(0, operands.a(0, s, stride0), stride0);
    if (NA > 1) _tile_loadd(1, operands.a(1, s, stride1), stride1);
    _tile_loadd(2, operands.b_tile(0, s), kTileBytes);
    if (NB > 1) _tile_loadd(3, operands.b_tile(1, s), kTileBytes);
    _tile_dpbf16ps(4, 0, 2);
    if (NB > 1) _tile_dpbf16ps(5, 0, 3);
    if (NA > 1) _tile_dpbf16ps(6, 1, 2);
    if (NA > 1 && NB > 1) _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, sums.c[0][0], stride);
  if (NB > 1) _tile_stored(5, sums.c[0][1], stride);
  if (NA > 1) _tile_stored(6, sums.c[1][0], stride);
  if (NA > 1 && NB > 1) _tile_stored(7, sums.c[1][1], stride);
}

template <class Operands>
TUTEL_AMX void run_block(bool two_a, bool two_b, const Operands& operands, int64_t steps, const BlockSums& sums) {
  if (two_a && two_b) tile_block<2, 2>(operands, steps, sums);
  else if (two_a) tile_block<2, 1>(operands, steps, sums);
  else if (two_b) tile_block<1, 2>(operands, steps, sums);
  else tile_block<1, 1>(operands, steps, sums);
}

// The bias of outputs [o, o + n), n <= 16, as floats (zero without a bias).
TUTEL_AMX inline __m512 load_bias(const bfloat16* bias, int64_t o, int64_t n) {
  if (!bias) return _mm512_setzero_ps();
  return avx512::widen_bf16(_mm256_maskz_loadu_epi16(__mmask16((uint32_t(1) << n) - 1u), bias + o));
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
  const int64_t steps = (inner + kInnerStep - 1) / kInnerStep;
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
  const void* b_tile(int j, int64_t s) const { return chunk[s * tiles + t_o + j].pairs; }
};

// [K, O] matrices: outputs [o_begin, o_end) of product p, whose token rows are packed as A tiles in
// `rows`.  `chunk` holds chunk_steps x (o_end - o_begin) / 16 tiles and `carried` one tile per
// (token block, output tile) of scratch.
TUTEL_AMX void inner_by_outputs(const SkinnyProduct<bfloat16>& p, const PackedTile* rows, int64_t inner,
                                int64_t o_begin, int64_t o_end, PackedTile* chunk, float* carried) {
  const int64_t steps = (inner + kInnerStep - 1) / kInnerStep;
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

// Work items: (product, range of outputs).  [O, K] matrices: 64 outputs (their rows are read whole
// whatever the range).  [K, O] matrices: the widest multiple of 32 outputs that still gives every
// thread an item, so that their rows are read whole once there are as many products as threads,
// up to 1024 outputs: wider items leave a chunk too few steps (kChunkTiles) and pass the sums
// through memory after each.  Measured with 8 experts of Mixtral-like [1024, 3584] at 64 rows:
// 11.6 ms with items 3584 wide (one step per chunk), 9.5 with 1024 (the GEMM 9.4); at 16 / 32 rows
// 4.0 / 6.2 against 4.2 / 5.6.
constexpr int64_t kOutputsPerItem = 64;
constexpr int64_t kMaxWideItemOutputs = 1024;

int64_t outputs_per_item(WeightLayout layout, size_t products, int64_t outputs) {
  if (layout == WeightLayout::kOutputsByInner) return kOutputsPerItem;
  const int64_t per_product = std::max<int64_t>(1, (max_parallelism() + int64_t(products) - 1) / int64_t(products));
  const int64_t width = (outputs + per_product - 1) / per_product;
  const int64_t rounded = (width + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  return std::min(kMaxWideItemOutputs, std::max<int64_t>(2 * kTileRows, rounded));
}

struct TileWork {
  const std::vector<SkinnyProduct<bfloat16>>& products;
  const std::vector<int64_t>& first_tile;  // per product: index of its first packed tile
  const PackedTile* packed;
  int64_t inner, outputs, width, items_per_product, max_rows;
  WeightLayout layout;
};

// Runs the items this thread claims from `queue` until none is left.
TUTEL_AMX void run_items(const TileWork& work, WorkQueue& queue) {
  load_tile_config();
  const int64_t width = work.width, tiles = width / kTileRows;
  alignas(64) bfloat16 spare[2 * kTileRows * kInnerStep];
  // [K, O] scratch, kept per thread between calls (hundreds of KiB, faulted in once).
  static thread_local std::vector<PackedTile> chunk, carried;
  if (work.layout == WeightLayout::kInnerByOutputs) {
    const size_t carried_tiles = size_t((work.max_rows + kTileRows - 1) / kTileRows * tiles);
    // An item's chunk holds chunk_steps(t) x t <= max(kChunkTiles, t) tiles for its t <= tiles.
    const size_t chunk_tiles = size_t(std::max(kChunkTiles, tiles));
    if (chunk.size() < chunk_tiles) chunk.resize(chunk_tiles);
    if (carried.size() < carried_tiles) carried.resize(carried_tiles);
  }
  for (int64_t item = queue.claim(); item >= 0; item = queue.claim()) {
    const SkinnyProduct<bfloat16>& p = work.products[item / work.items_per_product];
    const PackedTile* rows = work.packed + work.first_tile[item / work.items_per_product];
    const int64_t o_begin = (item % work.items_per_product) * width;
    const int64_t o_end = std::min(work.outputs, o_begin + width);
    if (work.layout == WeightLayout::kOutputsByInner) {
      outputs_by_inner(p, rows, work.inner, work.outputs, o_begin, o_end, spare);
    } else {
      inner_by_outputs(p, rows, work.inner, o_begin, o_end, chunk.data(),
                       reinterpret_cast<float*>(carried.data()));
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
  const int64_t steps = (inner + kInnerStep - 1) / kInnerStep;
  // Every product's token rows packed once, up front, by every thread: (product, block of 16 rows).
  std::vector<int64_t> first_tile(products.size() + 1, 0);
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (size_t i = 0; i < products.size(); ++i) {
    const int64_t count = (products[i].rows + kTileRows - 1) / kTileRows;
    for (int64_t b = 0; b < count; ++b) blocks.push_back({int64_t(i), b});
    first_tile[i + 1] = first_tile[i] + count * steps;
  }
  // Kept per calling thread between calls, as the grouped operator's other buffers are: as large
  // as the largest call's token rows.
  static thread_local std::vector<PackedTile> packed;
  if (packed.size() < size_t(first_tile.back())) packed.resize(size_t(first_tile.back()));
  PackedTile* const tiles = packed.data();
  parallel_for(0, int64_t(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [index, block] = blocks[i];
      pack_rows(products[index], block, inner, layout, tiles + first_tile[index] + block * steps);
    }
  });
  int64_t max_rows = 0;
  std::vector<double> rows;
  for (const SkinnyProduct<bfloat16>& p : products) {
    max_rows = std::max(max_rows, p.rows);
    rows.push_back(double(p.rows));
  }
  const int64_t width = outputs_per_item(layout, products.size(), outputs);
  const int64_t items_per_product = (outputs + width - 1) / width;
  const TileWork work{products, first_tile, tiles, inner, outputs, width, items_per_product, max_rows, layout};
  // The threads claim items as they finish the last, those of the products with the most rows
  // first: an item's time follows its product's rows, which differ from expert to expert.
  WorkQueue queue(grouped_longest_first(rows, items_per_product));
  parallel_for(0, max_parallelism(), 1, [&](int64_t, int64_t) { run_items(work, queue); });
}

}  // namespace core
}  // namespace tutel

#else

namespace tutel {
namespace core {

bool tile_products_available() { return false; }

void tile_products(const std::vector<SkinnyProduct<bfloat16>>&, int64_t, int64_t, WeightLayout) {}

}  // namespace core
}  // namespace tutel

#endif
