// The CPU GEMM's policy (gemm/policy.h): which line applies on which CPU, the token rows' byte bound
// of the AVX2 float32 products, and which product each group of a call gets.  The CPUs are
// described by hand, so every branch runs on any machine.
#include <gtest/gtest.h>

#include <vector>

#include "gemm/policy.h"

using namespace tutel::gemm;

namespace {

constexpr WeightLayout kOK = WeightLayout::kOutputsByInner;  // [O, K]
constexpr WeightLayout kKO = WeightLayout::kInnerByOutputs;  // [K, O]

// The 2-core AMD EPYC (Zen 3): AVX2 skinny kernels, no AVX-512 in PyTorch's GEMM either.
constexpr CpuUnits kZen3{256, false, false, false};
// The Intel Xeon with AVX-512, AVX512-BF16 and AMX, running the AVX-512 skinny kernels.
constexpr CpuUnits kXeon{512, true, true, true};
// The same Xeon with an AVX2-only build of the skinny kernels.
constexpr CpuUnits kXeonAvx2{256, true, true, true};
// A CPU with AVX-512 and AVX512-BF16 but no AMX tiles.
constexpr CpuUnits kAvx512Bf16{512, true, true, false};

int64_t skinny(Element element, WeightLayout layout, const CpuUnits& units, int64_t inner = 1024) {
  return product_lines(element, layout, inner, units).skinny_max_rows;
}

TEST(GemmPolicy, Avx2Float32OutputsByInnerBoundedByRowBytes) {
  // 160 KiB of float32 token rows: 40 rows of 1024 values (capped at 32), 26 of 1536, 20 of 2048;
  // never fewer than 20 rows whatever their length.
  EXPECT_EQ(skinny(Element::kFloat32, kOK, kZen3, 1024), 32);
  EXPECT_EQ(skinny(Element::kFloat32, kOK, kZen3, 1280), 32);
  EXPECT_EQ(skinny(Element::kFloat32, kOK, kZen3, 1536), 26);
  EXPECT_EQ(skinny(Element::kFloat32, kOK, kZen3, 2048), 20);
  EXPECT_EQ(skinny(Element::kFloat32, kOK, kZen3, 14336), 20);
  EXPECT_EQ(skinny(Element::kFloat32, kOK, kZen3, 0), 32);
  // [K, O] matrices and 16-bit rows keep the plain line at any length.
  EXPECT_EQ(skinny(Element::kFloat32, kKO, kZen3, 14336), 32);
  EXPECT_EQ(skinny(Element::kBFloat16, kOK, kZen3, 14336), 32);
  EXPECT_EQ(skinny(Element::kFloat16, kOK, kZen3, 14336), 32);
}

TEST(GemmPolicy, LinesBesideAGemmWithWiderUnits) {
  // AVX2 skinny products beside full-width FMA / native bfloat16 dot products, both layouts.
  for (WeightLayout layout : {kOK, kKO}) {
    EXPECT_EQ(skinny(Element::kFloat32, layout, kXeonAvx2, 14336), lines::kSkinnyMaxRowsBesideWideFma);
    EXPECT_EQ(skinny(Element::kBFloat16, layout, kXeonAvx2), lines::kSkinnyMaxRowsBesideBf16Dot);
    EXPECT_EQ(skinny(Element::kFloat16, layout, kXeonAvx2), lines::kSkinnyMaxRows);
  }
  // AVX-512 skinny products: float32 to the plain line, bfloat16 by layout and tiles.
  EXPECT_EQ(skinny(Element::kFloat32, kOK, kXeon, 14336), lines::kSkinnyMaxRows);
  EXPECT_EQ(skinny(Element::kBFloat16, kOK, kXeon), lines::kWideSkinnyMaxRowsBesideTiles);
  EXPECT_EQ(skinny(Element::kBFloat16, kKO, kXeon), lines::kWideSkinnyMaxRowsBesideTilesInnerByOutputs);
  EXPECT_EQ(skinny(Element::kBFloat16, kOK, kAvx512Bf16), lines::kWideSkinnyMaxRowsBesideBf16Dot);
  EXPECT_EQ(skinny(Element::kBFloat16, kKO, kAvx512Bf16), lines::kWideSkinnyMaxRowsBesideBf16DotInnerByOutputs);
}

TEST(GemmPolicy, TilesOnlyForBfloat16WithAmx) {
  EXPECT_EQ(product_lines(Element::kBFloat16, kOK, 1024, kXeon).tile_max_rows, lines::kTileMaxRows);
  EXPECT_EQ(product_lines(Element::kBFloat16, kKO, 1024, kXeon).tile_max_rows, lines::kTileMaxRowsInnerByOutputs);
  EXPECT_EQ(product_lines(Element::kBFloat16, kOK, 1024, kAvx512Bf16).tile_max_rows, 0);
  EXPECT_EQ(product_lines(Element::kFloat32, kOK, 1024, kXeon).tile_max_rows, 0);
  EXPECT_EQ(product_lines(Element::kFloat16, kKO, 1024, kXeon).tile_max_rows, 0);
  // Neither product takes other element types (float64).
  const ProductLines other = product_lines(Element::kOther, kOK, 1024, kXeon);
  EXPECT_EQ(other.skinny_max_rows, 0);
  EXPECT_EQ(other.tile_max_rows, 0);
}

TEST(GemmPolicy, LinesAreOrdered) {
  // Each tile line lies past the skinny lines beside it, so no group size falls between products.
  EXPECT_LT(lines::kWideSkinnyMaxRowsBesideTiles, lines::kTileMaxRows);
  EXPECT_LT(lines::kWideSkinnyMaxRowsBesideTilesInnerByOutputs, lines::kTileMaxRowsInnerByOutputs);
  EXPECT_LE(lines::kSkinnyRowsOfAnyLength, lines::kSkinnyMaxRows);
}

TEST(GemmPolicy, ChoosesEachGroupsProduct) {
  // Groups of 0, 1, 3, 4, 256, 257 and 2 rows with the skinny line at 3 and the tile line at 256.
  const std::vector<int64_t> offsets{0, 0, 1, 4, 8, 264, 521, 523};
  const std::vector<GroupProduct> chosen = choose_products(offsets, {3, 256});
  const std::vector<GroupProduct> expected{GroupProduct::kGemm, GroupProduct::kSkinny, GroupProduct::kSkinny,
                                           GroupProduct::kTile, GroupProduct::kTile,   GroupProduct::kGemm,
                                           GroupProduct::kSkinny};
  EXPECT_EQ(chosen, expected);
  // Without tiles everything past the skinny line is the GEMM's; without groups nothing is chosen.
  const std::vector<GroupProduct> no_tiles = choose_products({0, 32, 65}, {32, 0});
  EXPECT_EQ(no_tiles, (std::vector<GroupProduct>{GroupProduct::kSkinny, GroupProduct::kGemm}));
  EXPECT_TRUE(choose_products({0}, {32, 0}).empty());
  EXPECT_TRUE(choose_products({}, {32, 0}).empty());
}

TEST(GemmPolicy, MaxPieceCostIsHalfAThreadsShare) {
  EXPECT_DOUBLE_EQ(max_piece_cost(1000.0, 2), 250.0);
  EXPECT_DOUBLE_EQ(max_piece_cost(1000.0, 1), 500.0);
  EXPECT_DOUBLE_EQ(max_piece_cost(1000.0, 0), 500.0);  // no threads reported: one
}

TEST(GemmPolicy, ThisCpusUnitsMatchItsKernels) {
  // cpu_units reads the kernels' widths for the element type and layout.
  for (WeightLayout layout : {kOK, kKO}) {
    const SkinnyKernels<float>& kernels = skinny_kernels<float>();
    const int bits = layout == kOK ? kernels.outputs_by_inner_bits : kernels.inner_by_outputs_bits;
    EXPECT_EQ(cpu_units(Element::kFloat32, layout).skinny_bits, bits);
    EXPECT_EQ(cpu_units(Element::kOther, layout).skinny_bits, 0);
  }
}

}  // namespace
