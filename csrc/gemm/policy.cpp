#include "policy.h"

#include <algorithm>

#include "cpu_gemm_units.h"
#include "tile_gemm.h"

namespace tutel {
namespace gemm {
namespace {

template <class T>
int skinny_bits(WeightLayout layout) {
  const SkinnyKernels<T>& kernels = skinny_kernels<T>();
  return layout == WeightLayout::kOutputsByInner ? kernels.outputs_by_inner_bits : kernels.inner_by_outputs_bits;
}

int64_t skinny_max_rows(Element element, WeightLayout layout, int64_t inner, const CpuUnits& units) {
  using namespace lines;
  const bool outputs_by_inner = layout == WeightLayout::kOutputsByInner;
  const bool wide_skinny = units.skinny_bits == 512;
  if (element == Element::kOther) return 0;
  if (element == Element::kFloat32 && units.gemm_wide_fma)
    return wide_skinny ? kSkinnyMaxRows : kSkinnyMaxRowsBesideWideFma;
  if (element == Element::kBFloat16 && units.gemm_bf16_dot) {
    if (!wide_skinny) return kSkinnyMaxRowsBesideBf16Dot;
    if (outputs_by_inner) return units.tiles ? kWideSkinnyMaxRowsBesideTiles : kWideSkinnyMaxRowsBesideBf16Dot;
    return units.tiles ? kWideSkinnyMaxRowsBesideTilesInnerByOutputs : kWideSkinnyMaxRowsBesideBf16DotInnerByOutputs;
  }
  if (!outputs_by_inner || element != Element::kFloat32 || wide_skinny) return kSkinnyMaxRows;
  // AVX2 float32 [O, K]: bounded by the token rows' bytes past the rows of any length.
  const int64_t row_bytes = std::max<int64_t>(1, inner) * int64_t(sizeof(float));
  return std::max(kSkinnyRowsOfAnyLength, std::min(kSkinnyMaxRows, kSkinnyMaxRowBytes / row_bytes));
}

}  // namespace

CpuUnits cpu_units(Element element, WeightLayout layout) {
  int bits = 0;
  switch (element) {
    case Element::kFloat32: bits = skinny_bits<float>(layout); break;
    case Element::kBFloat16: bits = skinny_bits<bfloat16>(layout); break;
    case Element::kFloat16: bits = skinny_bits<float16>(layout); break;
    case Element::kOther: break;
  }
  return {bits, cpu_gemm_has_wide_fma(), cpu_gemm_has_bf16_dot(), tile_products_available()};
}

ProductLines product_lines(Element element, WeightLayout layout, int64_t inner, const CpuUnits& units) {
  const bool tiles = element == Element::kBFloat16 && units.tiles;
  const int64_t tile_max_rows =
      !tiles ? 0
             : layout == WeightLayout::kOutputsByInner ? lines::kTileMaxRows : lines::kTileMaxRowsInnerByOutputs;
  return {skinny_max_rows(element, layout, inner, units), tile_max_rows};
}

std::vector<GroupProduct> choose_products(const std::vector<int64_t>& offsets, const ProductLines& lines) {
  std::vector<GroupProduct> chosen(offsets.empty() ? 0 : offsets.size() - 1, GroupProduct::kGemm);
  for (size_t g = 0; g < chosen.size(); ++g) {
    const int64_t rows = offsets[g + 1] - offsets[g];
    if (rows < 1) continue;
    if (rows <= lines.skinny_max_rows) {
      chosen[g] = GroupProduct::kSkinny;
    } else if (rows <= lines.tile_max_rows) {
      chosen[g] = GroupProduct::kTile;
    }
  }
  return chosen;
}

double max_piece_cost(double total, int threads) { return total / double(2 * std::max(1, threads)); }

}  // namespace gemm
}  // namespace tutel
