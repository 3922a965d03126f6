// CPU implementation of grouped_linear and its backward: one linear map per
// group of consecutive rows, every group's product issued from one call (no
// Python loop, no padding to the largest group).  Each product writes straight
// into its rows of the output, so nothing is gathered or copied.
//
// Groups of a few rows (decoding, small batches over many experts) run tutel's
// skinny products, which read each expert's matrix once (gemm/skinny_gemm.h);
// bfloat16 groups past them run on AMX tiles where the CPU has them
// (gemm/tile_gemm.h); larger groups run PyTorch's GEMM, one single-threaded
// product per thread (gemm/work_balance.h says why).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "../../gemm/cpu_gemm_units.h"
#include "../../gemm/skinny_gemm.h"
#include "../../gemm/tile_gemm.h"
#include "../../gemm/work_balance.h"
#include "../checks.h"
#include "../core_types.h"
#include "grouped_linear_cpu.h"
#include "reusable_buffers.h"

namespace tutel {
namespace ops {
namespace {

// weight[g] as the [K, O] matrix the rows are multiplied by.
at::Tensor right_factor(const at::Tensor& weight, int64_t group, bool weight_transposed) {
  at::Tensor w = weight.select(0, group);
  return weight_transposed ? w.t() : w;
}

// Groups of at most this many rows take the skinny products: below it PyTorch's GEMM
// (packing the matrix for every product) is slower on every CPU measured
// (benchmarks/grouped_gemm.py, docs/performance.md).
constexpr int64_t kSkinnyMaxRows = 32;

// For [O, K] matrices in float32 and groups of more than kSkinnyRowsOfAnyLength rows, also at
// most this many bytes of token rows: each pass over a pair of matrix rows reads four of the
// group's token rows again, and past about L2's share they come from further out, while
// PyTorch's GEMM packs the matrix once for all of them.  16-bit rows keep the plain bound: their
// GEMM alternative is slower still without 16-bit dot products, and [K, O] matrices stream past
// per-thread sums instead.  The AVX-512 products read the token rows in chunks that stay in L1
// (gemm/skinny_avx512_dot.h), so the bound is for the AVX2 ones.
constexpr int64_t kSkinnyMaxRowBytes = int64_t(160) << 10;

// Up to this many rows the skinny products beat PyTorch's GEMM for float32 [O, K] matrices of
// any row length: the GEMM packs each expert's whole matrix for a handful of rows.  Measured on
// Zen 3, 2 threads, 8 experts, each product after a 64 MB read, as GB/s of matrix read (skinny
// / GEMM): [4096, 14336] (Mixtral-8x7B's down projection) at 3 / 4 / 8 / 12 / 16 / 20 / 24 rows
// 21 / 26 / 17 / 12 / 9.4 / 7.1 / 5.8 against 8.8 / 10 / 9.3 / 7.9 / 7.5 / 7.1 / 6.6; [4096, 7168]
// at 4 / 8 / 16 rows 27 / 18 / 7.9 against 11 / 11 / 7.6; [1024, 3584] at 16 / 20 / 24 / 32 rows
// 10.6 / 8.3 / 6.5 / 4.3 against 8.8 / 6.9 / 7.2 / 5.7; [1024, 2048] at 16 / 24 / 32 rows
// 8.2 / 6.6 / 5.3 against 7.5 / 7.3 / 6.4.
constexpr int64_t kSkinnyRowsOfAnyLength = 20;

// Where PyTorch's GEMM has units the AVX2 skinny products lack (gemm/cpu_gemm_units.h) it
// overtakes them at fewer rows, in both layouts: from about 9 rows for float32 with full-width
// 512-bit FMA, from about 5 for bfloat16 with native bfloat16 dot products (AMX computes a tile of
// them at once).  Measured on an Intel Xeon with AVX-512 and AMX, 2 threads, 8 experts, each
// product after a 600 MB read, ms skinny / GEMM: float32 [O, K] 1024 x 1024 at 8 / 12 / 16 rows
// 1.49 / 2.36 / 3.07 against 2.09 / 2.80 / 2.74, 1024 x 512 0.93 / 1.42 / 2.57 against 1.02 / 1.31 /
// 1.52, 7168 x 1024 at 8 / 12 rows 12.2 / 30.0 against 21.3 / 27.5; [K, O] 1024 x 512 at 8 rows
// 1.27 against 0.97; bfloat16 [O, K] 7168 x 1024 at 4 / 6 / 8 rows 9.0 / 13.4 / 12.4 against 8.7 /
// 10.9 / 7.9, 1024 x 3584 3.1 / 5.2 / 6.8 against 3.6 / 3.8 / 3.7.  At 1-2 rows the skinny
// products took 0.3-0.7x the GEMM's time.
constexpr int64_t kSkinnyMaxRowsBesideWideFma = 8;
constexpr int64_t kSkinnyMaxRowsBesideBf16Dot = 4;

// The AVX-512 skinny products (gemm/skinny_gemm_avx512.cpp) run on the same units as such a GEMM
// and keep their lead further: float32 to 32 rows in both layouts whatever the row length,
// bfloat16 to 6 rows of [O, K] and 8 of [K, O].  Measured on the same Xeon, 8 active experts, each
// product after a 600 MB read, ms AVX-512 skinny / GEMM in two runs: float32 [O, K] 1024 x 1024 at
// 16 / 24 / 32 rows 2.50-2.75 / 3.08-3.51 / 3.88-4.70 against 3.16-4.07 / 3.62-3.76 / 4.38-4.96, 1024
// x 3584 at 8 / 16 / 24 / 32 rows 5.4-6.2 / 7.4-9.6 / 9.6-13.1 / 12.1-16.0 against 12.6-15.0 /
// 10.7-11.3 / 12.1-12.8 / 14.8-15.4; [K, O] 1024 x 1024 at 16 / 24 / 32 rows 2.90-2.94 / 3.60-3.80 /
// 4.69-4.98 against 3.55-3.93 / 4.16-4.17 / 4.60-4.85, 3584 x 1024 8.1-8.6 / 8.3-10.4 / 11.4-13.8
// against 11.9-12.2 / 13.2-14.2 / 16.1-16.6; bfloat16 [O, K] 1024 x 1024 at 6 / 8 / 12 rows
// 1.02-1.33 / 1.24-1.46 / 1.69-2.00 against 1.93-2.18 / 1.65-1.90 / 1.76-1.93, 1024 x 3584 at 6 / 8
// rows 4.13-4.14 / 4.24-4.88 against 3.22-4.31 / 3.16-4.37; [K, O] 1024 x 2048 at 8 / 12 / 16 rows
// 3.35-3.42 / 4.05-4.87 / 5.29-6.30 against 3.82-4.25 / 4.01-4.30 / 4.23-4.63.
constexpr int64_t kWideSkinnyMaxRowsBesideBf16Dot = 6;
constexpr int64_t kWideSkinnyMaxRowsBesideBf16DotInnerByOutputs = 8;

// Where the CPU has AMX the tile products take over from 4 rows of [O, K] matrices: measured on the
// same Xeon, 8 experts, each product after a 600 MB read, the calls interleaved, ms skinny / tiles
// at 4 / 5 / 6 rows: [7168, 1024] 6.74 / 7.67 / 8.27 against 6.73 / 6.74 / 7.07, [1024, 3584] 4.23 /
// 4.28 / 4.82 against 3.23 / 2.98 / 3.06, [4096, 14336] 41.1 / 65.1 / 72.7 against 35.2 / 44.8 /
// 42.9, [2048, 768] 1.63 / 1.76 / 2.27 against 1.52 / 1.75 / 1.83, [1024, 1024] 1.15 / 1.32 / 1.34
// against 1.20 / 1.26 / 1.25, [512, 1024] 0.71 / 0.78 / 0.75 against 0.78 / 0.72 / 0.68; at 1-3
// rows each won on some shapes (3 rows: [7168, 1024] 6.29 against 7.18, [1024, 3584] 3.13
// against 2.49).
constexpr int64_t kWideSkinnyMaxRowsBesideTiles = 3;

// Where the CPU has AMX the tile products read [K, O] matrices of up to 16 rows in place
// (gemm/tile_gemm.h) and take over from 7 rows.  Measured on the same Xeon, ms skinny / tiles at 6 /
// 7 / 8 rows: 8 experts of [3584, 1024] 3.2 / 4.1 / 5.4 against 2.9 / 3.2 / 4.3, [1024, 3584] 2.5 /
// 3.7 / 4.0 against 2.8 / 3.4 / 3.1; 64 experts of [512, 1024] 3.6 / 4.3 / 4.5 against 3.5 / 3.4 /
// 3.3, [1024, 256] 2.5 / 3.5 / 3.1 against 2.5 / 4.1 / 3.1.
constexpr int64_t kWideSkinnyMaxRowsBesideTilesInnerByOutputs = 6;

// The vector width of the skinny products this CPU runs for `dtype` in `layout`.
int skinny_vector_bits(at::ScalarType dtype, gemm::WeightLayout layout) {
  const auto bits = [layout](const auto& kernels) {
    return layout == gemm::WeightLayout::kOutputsByInner ? kernels.outputs_by_inner_bits : kernels.inner_by_outputs_bits;
  };
  switch (dtype) {
    case at::kFloat: return bits(gemm::skinny_kernels<float>());
    case at::kBFloat16: return bits(gemm::skinny_kernels<gemm::bfloat16>());
    case at::kHalf: return bits(gemm::skinny_kernels<gemm::float16>());
    default: return 0;
  }
}

int64_t skinny_max_rows(const at::Tensor& rows, gemm::WeightLayout layout) {
  const at::ScalarType dtype = rows.scalar_type();
  const bool wide_skinny = skinny_vector_bits(dtype, layout) == 512;
  if (dtype == at::kFloat && gemm::cpu_gemm_has_wide_fma()) return wide_skinny ? kSkinnyMaxRows : kSkinnyMaxRowsBesideWideFma;
  if (dtype == at::kBFloat16 && gemm::cpu_gemm_has_bf16_dot()) {
    if (!wide_skinny) return kSkinnyMaxRowsBesideBf16Dot;
    if (layout == gemm::WeightLayout::kOutputsByInner)
      return gemm::tile_products_available() ? kWideSkinnyMaxRowsBesideTiles : kWideSkinnyMaxRowsBesideBf16Dot;
    return gemm::tile_products_available() ? kWideSkinnyMaxRowsBesideTilesInnerByOutputs
                                           : kWideSkinnyMaxRowsBesideBf16DotInnerByOutputs;
  }
  if (layout != gemm::WeightLayout::kOutputsByInner || dtype != at::kFloat || wide_skinny) return kSkinnyMaxRows;
  const int64_t row_bytes = std::max<int64_t>(1, rows.size(1)) * int64_t(sizeof(float));
  return std::max(kSkinnyRowsOfAnyLength, std::min(kSkinnyMaxRows, kSkinnyMaxRowBytes / row_bytes));
}

bool skinny_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// Group g's product: rows[offsets[g]:offsets[g+1]] times matrices[g] (+ bias[g]) into out's same
// rows.  `bias` is [groups, outputs] or undefined.
template <class T>
gemm::SkinnyProduct<core_t<T>> group_product(const at::Tensor& rows, const at::Tensor& matrices, const at::Tensor& bias,
                                             at::Tensor& out, const std::vector<int64_t>& offsets, size_t g) {
  return {core_ptr<T>(rows) + offsets[g] * rows.stride(0),
          rows.stride(0),
          core_ptr<T>(matrices) + int64_t(g) * matrices.stride(0),
          matrices.stride(1),
          bias.defined() ? core_ptr<T>(bias) + int64_t(g) * bias.stride(0) : nullptr,
          core_ptr<T>(out) + offsets[g] * out.stride(0),
          out.stride(0),
          offsets[g + 1] - offsets[g]};
}

// rows[offsets[g]:offsets[g+1]] times matrices[g] into out's same rows, for every group with
// 1..skinny_max_rows rows; marks them in `done`.  `layout` says how matrices[g] is read
// (its last dim must be contiguous), `bias` is [groups, outputs] or undefined.
template <class T>
void skinny_groups(const at::Tensor& rows, const at::Tensor& matrices, const at::Tensor& bias, at::Tensor& out,
                   const std::vector<int64_t>& offsets, gemm::WeightLayout layout, std::vector<bool>& done) {
  std::vector<gemm::SkinnyProduct<core_t<T>>> products;
  const int64_t max_rows = skinny_max_rows(rows, layout);
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t count = offsets[g + 1] - offsets[g];
    if (count < 1 || count > max_rows) continue;
    products.push_back(group_product<T>(rows, matrices, bias, out, offsets, g));
    done[g] = true;
  }
  gemm::skinny_products(products, rows.size(1), out.size(1), layout);
}

// Up to these many rows the AMX tile products (gemm/tile_gemm.h) beat PyTorch's bfloat16 GEMM,
// which repacks the matrix for every product.  Measured on an Intel Xeon with AMX, 2 threads,
// 8 active experts, each product after a 600 MB read, the two candidates' calls interleaved, ms
// tiles / GEMM.  [O, K] 1024 x 1024 at 8 / 16 / 64 / 256 rows: 1.25 / 1.19 / 2.30 / 7.05 against
// 2.26 / 2.27 / 3.36 / 7.18 (in separate runs 512 and 2048 rows took 14.2-21.4 and 60.5-83.1 against
// 13.3-15.1 and 49.0-59.4: there loading the tiles' matrix rows, a whole matrix row apart, costs more
// than the GEMM's repacking).  [K, O] 2048 x 1024 at 9 / 16 / 32 / 64 / 96 / 128 / 192 rows: 4.21 /
// 4.76 / 5.85 / 7.96 / 10.4 / 13.4 / 19.2 against 6.74 / 6.38 / 7.40 / 9.42 / 10.6 / 13.0 / 16.0 (the
// sums of larger groups pass through memory between chunks of matrix rows).  At 1-6 rows of [O, K]
// the skinny products and the tiles ran alike (1.12-1.40 against 0.98-1.32 ms).
constexpr int64_t kTileMaxRows = 256;
constexpr int64_t kTileMaxRowsInnerByOutputs = 64;

// The bfloat16 groups the skinny products leave, up to the tile products' line, on AMX tiles where
// the CPU has them; marks them in `done`.
void tile_groups(const at::Tensor& rows, const at::Tensor& matrices, const at::Tensor& bias, at::Tensor& out,
                 const std::vector<int64_t>& offsets, gemm::WeightLayout layout, std::vector<bool>& done) {
  if (rows.scalar_type() != at::kBFloat16 || !gemm::tile_products_available()) return;
  std::vector<gemm::SkinnyProduct<gemm::bfloat16>> products;
  const int64_t line = layout == gemm::WeightLayout::kOutputsByInner ? kTileMaxRows : kTileMaxRowsInnerByOutputs;
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t count = offsets[g + 1] - offsets[g];
    if (count < 1 || count > line || done[g]) continue;
    products.push_back(group_product<c10::BFloat16>(rows, matrices, bias, out, offsets, g));
    done[g] = true;
  }
  gemm::tile_products(products, rows.size(1), out.size(1), layout);
}

// Runs the groups the skinny products serve (see skinny_groups), then those the tile products serve
// (tile_groups); returns which ones ran.
std::vector<bool> run_skinny_groups(const at::Tensor& rows, const at::Tensor& matrices,
                                    const c10::optional<at::Tensor>& bias, at::Tensor& out,
                                    const std::vector<int64_t>& offsets, gemm::WeightLayout layout) {
  std::vector<bool> done(offsets.size() - 1, false);
  const bool bias_ok = !bias.has_value() || bias->stride(1) == 1;
  if (!skinny_dtype(rows.scalar_type()) || matrices.stride(2) != 1 || rows.stride(1) != 1 || out.stride(1) != 1 ||
      !bias_ok) {
    return done;
  }
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  switch (rows.scalar_type()) {
    case at::kFloat: skinny_groups<float>(rows, matrices, b, out, offsets, layout, done); break;
    case at::kBFloat16: skinny_groups<c10::BFloat16>(rows, matrices, b, out, offsets, layout, done); break;
    default: skinny_groups<c10::Half>(rows, matrices, b, out, offsets, layout, done); break;
  }
  tile_groups(rows, matrices, b, out, offsets, layout, done);
  return done;
}

// One GEMM of the grouped product: out = left @ right (+ bias), all views into the
// caller's tensors.  `cost` is its multiply-adds.
struct ProductPiece {
  at::Tensor out, left, right, bias;
  double cost;
};

// Pieces shorter than this along the dimension they are cut in lose more to packing
// the other operand than balancing wins back.
constexpr int64_t kMinPieceExtent = 128;

// Adds out = left @ right (+ bias) to `pieces`, cut along dim 0 of `out` and `left` into
// pieces of at most `max_cost` multiply-adds when that leaves each at least
// kMinPieceExtent long.  (For a weight gradient `left` is a transposed view of the
// rows, so its dim 0 is a feature dimension and the cut needs no sum of partial products.)
void add_product(std::vector<ProductPiece>& pieces, const at::Tensor& out, const at::Tensor& left,
                 const at::Tensor& right, const at::Tensor& bias, double max_cost) {
  const int64_t extent = out.size(0);
  const double cost = double(left.size(0)) * double(left.size(1)) * double(right.size(1));
  const int64_t count = gemm::pieces_to_cut(cost, max_cost, extent, kMinPieceExtent);
  for (int64_t p = 0; p < count; ++p) {
    const int64_t begin = extent * p / count, length = extent * (p + 1) / count - begin;
    pieces.push_back({out.narrow(0, begin, length), left.narrow(0, begin, length), right, bias,
                      cost * double(length) / double(extent)});
  }
}

// Runs every piece: with several threads, each piece as one single-threaded GEMM and the
// pieces claimed by the threads as they finish the last, largest first; else one after
// another (each GEMM threaded).
void run_pieces(const std::vector<ProductPiece>& pieces) {
  auto run = [&](const ProductPiece& piece) {
    at::Tensor out = piece.out;
    if (piece.bias.defined()) {
      at::addmm_out(out, piece.bias, piece.left, piece.right);
    } else {
      at::mm_out(out, piece.left, piece.right);
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), int64_t(pieces.size()));
  if (threads <= 1 || at::in_parallel_region()) {
    for (const ProductPiece& piece : pieces) run(piece);
    return;
  }
  std::vector<double> costs;
  costs.reserve(pieces.size());
  for (const ProductPiece& piece : pieces) costs.push_back(piece.cost);
  gemm::WorkQueue queue(gemm::longest_first(costs));
  // Grain 1 over the workers: each claims pieces until none is left, and the GEMMs inside a
  // parallel region run single-threaded.  The pool's threads take this thread's dispatch
  // state (below autograd), or the out= products would refuse tensors that need grad.
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    for (int64_t item = queue.claim(); item >= 0; item = queue.claim()) run(pieces[size_t(item)]);
  });
}

// The largest piece worth keeping whole when `total` multiply-adds are spread over the
// threads: half of one thread's share, so that the threads' last claims end close together
// (finer cuts pack the other operand more often: Mixtral-like T=8192 ran 1.3x slower at a
// quarter with 64-row pieces).
double max_piece_cost(double total) { return total / double(2 * std::max(1, at::get_num_threads())); }

// How a product reads weight[g]: rows @ W^T for [O, K] matrices, rows @ W for [K, O].
gemm::WeightLayout layout_of(bool outputs_by_inner) {
  return outputs_by_inner ? gemm::WeightLayout::kOutputsByInner : gemm::WeightLayout::kInnerByOutputs;
}

// Row offsets of the groups; checks the counts against the rows of x.
std::vector<int64_t> group_offsets(at::IntArrayRef group_rows, int64_t groups, int64_t rows, const char* op) {
  TORCH_CHECK_VALUE(int64_t(group_rows.size()) == groups, "tutel::", op, ": `group_rows` has ",
                    group_rows.size(), " entries but `weight` holds ", groups, " groups");
  std::vector<int64_t> offsets(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK_VALUE(group_rows[g] >= 0, "tutel::", op, ": group_rows[", g, "] = ", group_rows[g],
                      " is negative; row counts must be >= 0");
    offsets[g + 1] = offsets[g] + group_rows[g];
  }
  TORCH_CHECK_VALUE(offsets[groups] == rows, "tutel::", op, ": `group_rows` sums to ", offsets[groups],
                    " but `x` has ", rows, " rows");
  return offsets;
}

void check_operands(const at::Tensor& x, const at::Tensor& weight, bool weight_transposed, const char* op) {
  check_dim(x, 2, op, "x");
  check_dim(weight, 3, op, "weight");
  check_floating(x, op, "x");
  check_dtype(weight, x.scalar_type(), op, "weight");
  check_same_device(x, weight, op, "weight");
  const int64_t inner = weight_transposed ? weight.size(2) : weight.size(1);
  TORCH_CHECK_VALUE(inner == x.size(1), "tutel::", op, ": `x` has ", x.size(1), " features but `weight` ",
                    weight.sizes(), (weight_transposed ? " (transposed)" : ""), " expects ", inner);
}

}  // namespace

at::Tensor grouped_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                              at::IntArrayRef group_rows, bool weight_transposed) {
  const char* op = "grouped_linear";
  check_operands(x_in, weight, weight_transposed, op);
  const at::Tensor x = rows_with_unit_stride(x_in);
  const int64_t groups = weight.size(0);
  const int64_t outputs = weight_transposed ? weight.size(1) : weight.size(2);
  if (bias.has_value()) {
    check_dtype(*bias, x.scalar_type(), op, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 2 && bias->size(0) == groups && bias->size(1) == outputs, "tutel::", op,
                      ": `bias` must have shape [", groups, ", ", outputs, "], got ", bias->sizes());
  }
  const std::vector<int64_t> offsets = group_offsets(group_rows, groups, x.size(0), op);
  at::Tensor out = empty_reusable({x.size(0), outputs}, x.options());
  // weight_transposed: weight[g] is [O, K] and the rows are multiplied by its transpose.
  const std::vector<bool> done = run_skinny_groups(x, weight, bias, out, offsets, layout_of(weight_transposed));
  const double max_cost = max_piece_cost(double(x.size(0)) * double(x.size(1)) * double(outputs));
  std::vector<ProductPiece> pieces;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = offsets[g + 1] - offsets[g];
    if (count == 0 || done[g]) continue;
    add_product(pieces, out.narrow(0, offsets[g], count), x.narrow(0, offsets[g], count),
                right_factor(weight, g, weight_transposed), bias.has_value() ? bias->select(0, g) : at::Tensor(),
                max_cost);
  }
  run_pieces(pieces);
  return out;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> grouped_linear_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& weight, at::IntArrayRef group_rows,
    bool weight_transposed, std::array<bool, 3> output_mask) {
  const char* op = "grouped_linear_backward";
  check_operands(x_in, weight, weight_transposed, op);
  const at::Tensor x = x_in.contiguous(), grad = grad_in.contiguous();
  const int64_t groups = weight.size(0);
  const int64_t outputs = weight_transposed ? weight.size(1) : weight.size(2);
  check_dtype(grad, x.scalar_type(), op, "grad");
  TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == x.size(0) && grad.size(1) == outputs, "tutel::", op,
                    ": `grad` must have shape [", x.size(0), ", ", outputs, "], got ", grad.sizes());
  const std::vector<int64_t> offsets = group_offsets(group_rows, groups, x.size(0), op);

  // Gradients not asked for come back as empty tensors.
  at::Tensor grad_x = empty_reusable({output_mask[0] ? x.size(0) : 0, x.size(1)}, x.options());
  at::Tensor grad_weight = output_mask[1] ? empty_reusable(weight.sizes(), weight.options()) : at::empty({0}, x.options());
  at::Tensor grad_bias = at::empty({output_mask[2] ? groups : 0, outputs}, x.options());
  // d x = d y @ W^T reads weight[g] the other way round from the forward product.
  const std::vector<bool> skinny_grad_x =
      output_mask[0] ? run_skinny_groups(grad, weight, c10::nullopt, grad_x, offsets, layout_of(!weight_transposed))
                     : std::vector<bool>(groups, false);
  // Both gradients' products, spread over the threads together.
  const double max_cost =
      max_piece_cost(double(x.size(0)) * double(x.size(1)) * double(outputs) * (output_mask[0] + output_mask[1]));
  std::vector<ProductPiece> pieces;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = offsets[g + 1] - offsets[g];
    const at::Tensor rows_grad = grad.narrow(0, offsets[g], count);
    const at::Tensor rows_in = x.narrow(0, offsets[g], count);
    if (count > 0 && output_mask[0] && !skinny_grad_x[g]) {
      // d x = d y @ W^T: weight[g] read the other way round from the forward product.
      add_product(pieces, grad_x.narrow(0, offsets[g], count), rows_grad, right_factor(weight, g, !weight_transposed),
                  at::Tensor(), max_cost);
    }
    if (output_mask[1]) {
      // d W has weight[g]'s layout: [K, O] = x^T dy, or [O, K] = dy^T x.  A group
      // without rows contributes nothing (a zero gradient).
      at::Tensor dw = grad_weight.select(0, g);
      if (count == 0) {
        dw.zero_();
      } else if (weight_transposed) {
        add_product(pieces, dw, rows_grad.t(), rows_in, at::Tensor(), max_cost);
      } else {
        add_product(pieces, dw, rows_in.t(), rows_grad, at::Tensor(), max_cost);
      }
    }
    if (output_mask[2]) {
      at::Tensor db = grad_bias.select(0, g);
      if (count == 0) {
        db.zero_();
      } else {
        at::sum_out(db, rows_grad, {0});
      }
    }
  }
  run_pieces(pieces);
  return {grad_x, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("grouped_linear", &grouped_linear_cpu);
  m.impl("grouped_linear_backward", &grouped_linear_backward_cpu);
}

}  // namespace ops
}  // namespace tutel
