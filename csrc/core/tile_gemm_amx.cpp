// AMX tile products (tile_gemm.h).  Every function that touches tiles or 512-bit registers carries
// TUTEL_AMX, so this file compiles with the baseline flags and its code runs only after
// tile_products_available().
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its (maybe-)uninitialized warnings
// flag at every inlined use; this file holds nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "tile_gemm.h"

#include <algorithm>

#include "parallel.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx2_lanes.h"

#define TUTEL_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,amx-tile,amx-bf16")))

namespace tutel {
namespace core {
namespace {

// Every tile is 16 rows of 64 bytes: A holds 16 matrix rows x 32 inner values, B 16 interleaved
// pairs of inner values x 16 token rows, C 16 x 16 float sums.
constexpr int64_t kTileRows = 16;
constexpr int64_t kInnerStep = 32;  // inner values per tile product
constexpr int64_t kTileBytes = 64;

// One tile of packed token rows: B's 16 rows of 16 (x[t][2p], x[t][2p + 1]) pairs.
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

// Tiles 0-1: A (matrix rows), 2-3: B (token rows), 4-7: C (sums, C[i][j] in tile 4 + 2 i + j).
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

// Token rows [16 b, 16 b + 16) of `p` as B tiles, one per step of 32 inner values; rows past
// p.rows and values past `inner` are zero.
TUTEL_AMX void pack_rows(const SkinnyProduct<bfloat16>& p, int64_t block, int64_t inner, PackedTile* out) {
  const int64_t steps = (inner + kInnerStep - 1) / kInnerStep;
  const int64_t first = block * kTileRows, count = std::min(kTileRows, p.rows - first);
  for (int64_t s = 0; s < steps; ++s) {
    __m512i r[16];
    for (int64_t i = 0; i < kTileRows; ++i)
      r[i] = i < count ? load_step(p.x + (first + i) * p.x_stride, s * kInnerStep, inner) : _mm512_setzero_si512();
    transpose_16x16(r);
    for (int64_t i = 0; i < kTileRows; ++i) _mm512_store_si512(out[s].pairs + i * kTileRows, r[i]);
  }
}

// Where an A tile comes from: matrix rows [o, o + 16) at inner step s, straight from the matrix
// when all 16 rows and 32 values exist, else copied with zeros into `spare`.
TUTEL_AMX inline const bfloat16* a_tile(const SkinnyProduct<bfloat16>& p, int64_t o, int64_t s, int64_t inner,
                                        int64_t outputs, bfloat16* spare, int64_t& stride_bytes) {
  const int64_t k = s * kInnerStep;
  const int64_t rows = std::min(kTileRows, outputs - o);
  if (rows == kTileRows && k + kInnerStep <= inner) {
    stride_bytes = p.w_stride * int64_t(sizeof(bfloat16));
    return p.w + o * p.w_stride + k;
  }
  for (int64_t i = 0; i < kTileRows; ++i) {
    const __m512i v = i < rows ? load_step(p.w + (o + i) * p.w_stride, k, inner) : _mm512_setzero_si512();
    _mm512_store_si512(spare + i * kInnerStep, v);
  }
  stride_bytes = kTileBytes;
  return spare;
}

// Sums of matrix rows [o, o + 16 NA) with token rows [16 b, 16 b + 16 NB) into `sums` ([32][32]
// floats: matrix row, then token row).
template <int NA, int NB>
TUTEL_AMX void tile_block(const SkinnyProduct<bfloat16>& p, const PackedTile* packed, int64_t steps, int64_t o,
                          int64_t b, int64_t inner, int64_t outputs, float* sums) {
  alignas(64) bfloat16 spare[2][kTileRows * kInnerStep];
  _tile_zero(4);
  if (NB > 1) _tile_zero(5);
  if (NA > 1) _tile_zero(6);
  if (NA > 1 && NB > 1) _tile_zero(7);
  for (int64_t s = 0; s < steps; ++s) {
    int64_t stride0 = 0, stride1 = 0;
    _tile_loadd(0, a_tile(p, o, s, inner, outputs, spare[0], stride0), stride0);
    if (NA > 1) _tile_loadd(1, a_tile(p, o + kTileRows, s, inner, outputs, spare[1], stride1), stride1);
    _tile_loadd(2, packed[b * steps + s].pairs, kTileBytes);
    if (NB > 1) _tile_loadd(3, packed[(b + 1) * steps + s].pairs, kTileBytes);
    _tile_dpbf16ps(4, 0, 2);
    if (NB > 1) _tile_dpbf16ps(5, 0, 3);
    if (NA > 1) _tile_dpbf16ps(6, 1, 2);
    if (NA > 1 && NB > 1) _tile_dpbf16ps(7, 1, 3);
  }
  constexpr int64_t kSumsStride = 2 * kTileRows * sizeof(float);
  _tile_stored(4, sums, kSumsStride);
  if (NB > 1) _tile_stored(5, sums + kTileRows, kSumsStride);
  if (NA > 1) _tile_stored(6, sums + kTileRows * 2 * kTileRows, kSumsStride);
  if (NA > 1 && NB > 1) _tile_stored(7, sums + kTileRows * 2 * kTileRows + kTileRows, kSumsStride);
}

// Writes one 16 x 16 block of `sums` (matrix rows [o, o + 16) from row `a` of it, token rows
// [t, t + 16) from column `c`) to y, transposed, plus bias: outputs [o, o_end), token rows below
// p.rows.
TUTEL_AMX void write_block(const SkinnyProduct<bfloat16>& p, const float* sums, int64_t a, int64_t c, int64_t o,
                           int64_t o_end, int64_t t) {
  const int64_t n = std::min(kTileRows, o_end - o), rows = std::min(kTileRows, p.rows - t);
  if (n <= 0 || rows <= 0) return;
  __m512i r[16];
  for (int64_t i = 0; i < kTileRows; ++i)
    r[i] = _mm512_load_si512(sums + (a + i) * 2 * kTileRows + c);
  transpose_16x16(r);
  const __mmask16 valid = __mmask16((uint32_t(1) << n) - 1u);
  __m512 bias = _mm512_setzero_ps();
  if (p.bias) {
    const __m256i bits = _mm256_maskz_loadu_epi16(valid, p.bias + o);
    bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[i]), bias);
    bfloat16* y = p.y + (t + i) * p.y_stride + o;
    if (n == kTileRows) {
      avx2::Lanes<bfloat16>::store(y, _mm512_castps512_ps256(v));
      avx2::Lanes<bfloat16>::store(y + 8, _mm512_extractf32x8_ps(v, 1));
    } else {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, v);
      for (int64_t j = 0; j < n; ++j) y[j] = Scalar<bfloat16>::store(lanes[j]);
    }
  }
}

// Outputs [o_begin, o_end) of product p, whose token rows are packed in `packed`.
TUTEL_AMX void product_outputs(const SkinnyProduct<bfloat16>& p, const PackedTile* packed, int64_t inner,
                               int64_t outputs, int64_t o_begin, int64_t o_end) {
  alignas(64) float sums[2 * kTileRows * 2 * kTileRows];
  const int64_t steps = (inner + kInnerStep - 1) / kInnerStep;
  const int64_t blocks = (p.rows + kTileRows - 1) / kTileRows;
  for (int64_t o = o_begin; o < o_end; o += 2 * kTileRows) {
    const bool two_a = o_end - o > kTileRows;
    for (int64_t b = 0; b < blocks; b += 2) {
      const bool two_b = blocks - b > 1;
      if (two_a && two_b) tile_block<2, 2>(p, packed, steps, o, b, inner, outputs, sums);
      else if (two_a) tile_block<2, 1>(p, packed, steps, o, b, inner, outputs, sums);
      else if (two_b) tile_block<1, 2>(p, packed, steps, o, b, inner, outputs, sums);
      else tile_block<1, 1>(p, packed, steps, o, b, inner, outputs, sums);
      for (int64_t i = 0; i < (two_a ? 2 : 1); ++i)
        for (int64_t j = 0; j < (two_b ? 2 : 1); ++j)
          write_block(p, sums, i * kTileRows, j * kTileRows, o + i * kTileRows, o_end, (b + j) * kTileRows);
    }
  }
}

// Work items: (product, tile of kOutputsPerItem outputs).
constexpr int64_t kOutputsPerItem = 64;

struct TileWork {
  const std::vector<SkinnyProduct<bfloat16>>& products;
  const std::vector<int64_t>& first_tile;  // per product: index of its first packed tile
  const PackedTile* packed;
  int64_t inner, outputs, items_per_product;
};

TUTEL_AMX void run_items(const TileWork& work, int64_t begin, int64_t end) {
  load_tile_config();
  for (int64_t item = begin; item < end; ++item) {
    const int64_t index = item / work.items_per_product;
    const int64_t o_begin = (item % work.items_per_product) * kOutputsPerItem;
    product_outputs(work.products[index], work.packed + work.first_tile[index], work.inner, work.outputs, o_begin,
                    std::min(work.outputs, o_begin + kOutputsPerItem));
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
  static const bool available = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                                os_grants_tile_data();
  return available;
}

void tile_products(const std::vector<SkinnyProduct<bfloat16>>& products, int64_t inner, int64_t outputs) {
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
  static thread_local std::vector<PackedTile> packed;
  if (packed.size() < size_t(first_tile.back())) packed.resize(size_t(first_tile.back()));
  PackedTile* const tiles = packed.data();
  parallel_for(0, int64_t(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [index, block] = blocks[i];
      pack_rows(products[index], block, inner, tiles + first_tile[index] + block * steps);
    }
  });
  const int64_t items_per_product = (outputs + kOutputsPerItem - 1) / kOutputsPerItem;
  const TileWork work{products, first_tile, tiles, inner, outputs, items_per_product};
  parallel_for(0, int64_t(products.size()) * items_per_product, 1,
               [&](int64_t begin, int64_t end) { run_items(work, begin, end); });
}

}  // namespace core
}  // namespace tutel

#else

namespace tutel {
namespace core {

bool tile_products_available() { return false; }

void tile_products(const std::vector<SkinnyProduct<bfloat16>>&, int64_t, int64_t) {}

}  // namespace core
}  // namespace tutel

#endif
