// Which product runs each group of a grouped product on this CPU: tutel's skinny products
// (skinny_gemm.h), its AMX tile products (tile_gemm.h) or PyTorch's GEMM.  Every size line of that
// choice is in the table below; the measurements behind each line are in docs/performance.md,
// section "CPU GEMM size lines", under the machine that measured them.
#pragma once

#include <cstdint>
#include <vector>

#include "skinny_gemm.h"

namespace tutel {
namespace gemm {

// The size lines.  "Zen 3": the 2-core AMD EPYC (AVX2); "Xeon": the Intel Xeon with AVX-512,
// AVX512-BF16 and AMX (docs/performance.md names both).
namespace lines {
// Skinny products up to this many rows per group (Zen 3: the GEMM packs the matrix for a few rows).
constexpr int64_t kSkinnyMaxRows = 32;
// float32 [O, K] with AVX2 past kSkinnyRowsOfAnyLength rows: also at most this many bytes of token
// rows (Zen 3: longer rows fall out of L2 on every pass).
constexpr int64_t kSkinnyMaxRowBytes = int64_t(160) << 10;
// ... but at least this many rows whatever the row length (Zen 3: Mixtral-8x7B's down projection).
constexpr int64_t kSkinnyRowsOfAnyLength = 20;
// AVX2 skinny products beside a GEMM on full-width 512-bit FMA, float32 (Xeon).
constexpr int64_t kSkinnyMaxRowsBesideWideFma = 8;
// AVX2 skinny products beside a GEMM with native bfloat16 dot products (Xeon).
constexpr int64_t kSkinnyMaxRowsBesideBf16Dot = 4;
// AVX-512 skinny products beside such a bfloat16 GEMM without AMX tiles, [O, K] (Xeon).
constexpr int64_t kWideSkinnyMaxRowsBesideBf16Dot = 6;
// The same for [K, O] matrices (Xeon).
constexpr int64_t kWideSkinnyMaxRowsBesideBf16DotInnerByOutputs = 8;
// AVX-512 skinny products beside the tile products, bfloat16 [O, K] (Xeon).
constexpr int64_t kWideSkinnyMaxRowsBesideTiles = 3;
// The same for [K, O] matrices, read in place by the tiles up to 16 rows (Xeon).
constexpr int64_t kWideSkinnyMaxRowsBesideTilesInnerByOutputs = 6;
// Tile products up to this many rows per bfloat16 group, [O, K] (Xeon: the GEMM's packed panels win past it).
constexpr int64_t kTileMaxRows = 256;
// The same for [K, O] matrices (Xeon: larger groups pass their sums through memory).
constexpr int64_t kTileMaxRowsInnerByOutputs = 64;
// GEMM pieces are never cut shorter than this (Xeon and Zen 3: packing the other operand costs more).
constexpr int64_t kMinPieceExtent = 128;
}  // namespace lines

// The element types of a grouped product, as far as the choice cares.
enum class Element { kFloat32, kBFloat16, kFloat16, kOther };

// What the lines depend on besides a group's size.
struct CpuUnits {
  int skinny_bits;     // the vector width of this CPU's skinny kernels for the type and layout: 512, 256 or 0
  bool gemm_wide_fma;  // cpu_gemm_has_wide_fma()
  bool gemm_bf16_dot;  // cpu_gemm_has_bf16_dot()
  bool tiles;          // tile_products_available()
};

// This CPU's units for products of `element` reading matrices in `layout`.
CpuUnits cpu_units(Element element, WeightLayout layout);

// The lines of one grouped product: groups of 1 to skinny_max_rows rows take the skinny products,
// larger ones up to tile_max_rows (0: none) the tile products, the rest PyTorch's GEMM.
struct ProductLines {
  int64_t skinny_max_rows;
  int64_t tile_max_rows;
};

// The lines for `element` in `layout` with `inner` values per token row, on a CPU with `units`.
ProductLines product_lines(Element element, WeightLayout layout, int64_t inner, const CpuUnits& units);

enum class GroupProduct : uint8_t { kGemm, kSkinny, kTile };

// Which product runs each group; group g holds rows offsets[g] .. offsets[g + 1] - 1.  Groups
// without rows are kGemm (there is nothing to run).
std::vector<GroupProduct> choose_products(const std::vector<int64_t>& offsets, const ProductLines& lines);

// The largest GEMM piece worth keeping whole when `total` multiply-adds are spread over `threads`:
// half of one thread's share, so that the threads' last claims end close together (finer cuts pack
// the other operand more often and ran slower: docs/performance.md, "Large groups: work balance").
double max_piece_cost(double total, int threads);

}  // namespace gemm
}  // namespace tutel
