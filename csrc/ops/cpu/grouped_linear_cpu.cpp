// CPU implementation of grouped_linear and its backward: one linear map per
// group of consecutive rows, every group's product issued from one call (no
// Python loop, no padding to the largest group).  Each product writes straight
// into its rows of the output, so nothing is gathered or copied.
//
// Which product runs a group is the CPU GEMM's policy (gemm/policy.h): groups of a
// few rows (decoding, small batches over many experts) take tutel's skinny products,
// which read each expert's matrix once (gemm/skinny_gemm.h); bfloat16 groups past them
// take AMX tiles where the CPU has them (gemm/tile_gemm.h); larger groups run PyTorch's
// GEMM, one single-threaded product per thread (gemm/work_balance.h says why).
// With TUTEL_CPU_GEMM=torch (cpu_gemm_switch.h) every group runs PyTorch's GEMM
// instead, one product after another.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../../gemm/policy.h"
#include "../../gemm/skinny_gemm.h"
#include "../../gemm/tile_gemm.h"
#include "../../gemm/work_balance.h"
#include "../checks.h"
#include "../core_types.h"
#include "cpu_gemm_switch.h"
#include "gemms_on_threads.h"
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

// The element type as the CPU GEMM's policy names it.
gemm::Element element_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return gemm::Element::kFloat32;
    case at::kBFloat16: return gemm::Element::kBFloat16;
    case at::kHalf: return gemm::Element::kFloat16;
    default: return gemm::Element::kOther;
  }
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

// Runs, in one parallel call each, the groups that `chosen` gives to `product` (kSkinny or kTile);
// matrices[g] is read in `layout` (its last dim contiguous), `bias` is [groups, outputs] or undefined.
template <class T>
void run_groups(gemm::GroupProduct product, const at::Tensor& rows, const at::Tensor& matrices, const at::Tensor& bias,
                at::Tensor& out, const std::vector<int64_t>& offsets, gemm::WeightLayout layout,
                const std::vector<gemm::GroupProduct>& chosen) {
  std::vector<gemm::SkinnyProduct<core_t<T>>> products;
  for (size_t g = 0; g < chosen.size(); ++g) {
    if (chosen[g] == product) products.push_back(group_product<T>(rows, matrices, bias, out, offsets, g));
  }
  if (products.empty()) return;
  if constexpr (std::is_same<core_t<T>, gemm::bfloat16>::value) {
    if (product == gemm::GroupProduct::kTile) return gemm::tile_products(products, rows.size(1), out.size(1), layout);
  }
  TORCH_INTERNAL_ASSERT(product == gemm::GroupProduct::kSkinny, "the tile products take bfloat16 only");
  gemm::skinny_products(products, rows.size(1), out.size(1), layout);
}

// Under tutel's CPU GEMM, runs the groups the policy gives to the skinny and the tile products;
// returns every group's product (kGemm: left to PyTorch's GEMM, as every group under `torch`).
std::vector<gemm::GroupProduct> run_skinny_and_tile_groups(CpuGemm choice, const at::Tensor& rows,
                                                           const at::Tensor& matrices,
                                                           const c10::optional<at::Tensor>& bias, at::Tensor& out,
                                                           const std::vector<int64_t>& offsets,
                                                           gemm::WeightLayout layout) {
  const gemm::Element element = element_of(rows.scalar_type());
  const bool bias_ok = !bias.has_value() || bias->stride(1) == 1;
  if (choice != CpuGemm::kTutel || element == gemm::Element::kOther || matrices.stride(2) != 1 ||
      rows.stride(1) != 1 || out.stride(1) != 1 || !bias_ok) {
    return std::vector<gemm::GroupProduct>(offsets.size() - 1, gemm::GroupProduct::kGemm);
  }
  const gemm::ProductLines lines =
      gemm::product_lines(element, layout, rows.size(1), gemm::cpu_units(element, layout));
  const std::vector<gemm::GroupProduct> chosen = gemm::choose_products(offsets, lines);
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  for (const gemm::GroupProduct product : {gemm::GroupProduct::kSkinny, gemm::GroupProduct::kTile}) {
    switch (rows.scalar_type()) {
      case at::kFloat: run_groups<float>(product, rows, matrices, b, out, offsets, layout, chosen); break;
      case at::kBFloat16: run_groups<c10::BFloat16>(product, rows, matrices, b, out, offsets, layout, chosen); break;
      default: run_groups<c10::Half>(product, rows, matrices, b, out, offsets, layout, chosen); break;
    }
  }
  return chosen;
}

// One GEMM of the grouped product: out = left @ right (+ bias), all views into the
// caller's tensors.  `cost` is its multiply-adds.
struct ProductPiece {
  at::Tensor out, left, right, bias;
  double cost;
};

void run_piece(const ProductPiece& piece) {
  at::Tensor out = piece.out;
  if (piece.bias.defined()) {
    at::addmm_out(out, piece.bias, piece.left, piece.right);
  } else {
    at::mm_out(out, piece.left, piece.right);
  }
}

// The GEMMs of one call, collected and then run together.  Under tutel's CPU GEMM products of
// more than max_cost multiply-adds are cut first, and with several threads each piece runs
// single-threaded, claimed by the threads as they finish the last, largest first (on one thread,
// one after another).  Under TUTEL_CPU_GEMM=torch the products run whole, one after another, each
// GEMM threaded by PyTorch.
class GemmPieces {
 public:
  // `total`: the multiply-adds of every product the call adds.
  GemmPieces(CpuGemm choice, double total)
      : tutel_(choice == CpuGemm::kTutel), max_cost_(gemm::max_piece_cost(total, at::get_num_threads())) {}

  // Adds out = left @ right (+ bias); under tutel's CPU GEMM cut along dim 0 of `out` and `left`
  // into pieces of at most max_cost multiply-adds when that leaves each at least
  // gemm::lines::kMinPieceExtent long.  (For a weight gradient `left` is a transposed view of the
  // rows, so its dim 0 is a feature dimension and the cut needs no sum of partial products.)
  void add(const at::Tensor& out, const at::Tensor& left, const at::Tensor& right, const at::Tensor& bias) {
    const int64_t extent = out.size(0);
    const double cost = double(left.size(0)) * double(left.size(1)) * double(right.size(1));
    const int64_t count =
        tutel_ ? gemm::pieces_to_cut(cost, max_cost_, extent, gemm::lines::kMinPieceExtent) : int64_t(1);
    for (int64_t p = 0; p < count; ++p) {
      const int64_t begin = extent * p / count, length = extent * (p + 1) / count - begin;
      pieces_.push_back({out.narrow(0, begin, length), left.narrow(0, begin, length), right, bias,
                         cost * double(length) / double(extent)});
    }
  }

  void run() const {
    if (!tutel_) {
      for (const ProductPiece& piece : pieces_) run_piece(piece);
      return;
    }
    std::vector<double> costs;
    costs.reserve(pieces_.size());
    for (const ProductPiece& piece : pieces_) costs.push_back(piece.cost);
    gemm::WorkQueue queue(gemm::longest_first(costs));
    claim_on_threads(int64_t(pieces_.size()), [&] {
      for (int64_t item = queue.claim(); item >= 0; item = queue.claim()) run_piece(pieces_[size_t(item)]);
    });
  }

 private:
  const bool tutel_;
  const double max_cost_;
  std::vector<ProductPiece> pieces_;
};

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
  const CpuGemm choice = cpu_gemm();
  const std::vector<gemm::GroupProduct> chosen =
      run_skinny_and_tile_groups(choice, x, weight, bias, out, offsets, layout_of(weight_transposed));
  GemmPieces pieces(choice, double(x.size(0)) * double(x.size(1)) * double(outputs));
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = offsets[g + 1] - offsets[g];
    if (count == 0 || chosen[g] != gemm::GroupProduct::kGemm) continue;
    pieces.add(out.narrow(0, offsets[g], count), x.narrow(0, offsets[g], count),
               right_factor(weight, g, weight_transposed), bias.has_value() ? bias->select(0, g) : at::Tensor());
  }
  pieces.run();
  return out;
}

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
  const CpuGemm choice = cpu_gemm();
  const std::vector<gemm::GroupProduct> grad_x_chosen =
      output_mask[0] ? run_skinny_and_tile_groups(choice, grad, weight, c10::nullopt, grad_x, offsets,
                                                  layout_of(!weight_transposed))
                     : std::vector<gemm::GroupProduct>(groups, gemm::GroupProduct::kGemm);
  // Both gradients' products, spread over the threads together.
  GemmPieces pieces(choice,
                    double(x.size(0)) * double(x.size(1)) * double(outputs) * (output_mask[0] + output_mask[1]));
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = offsets[g + 1] - offsets[g];
    const at::Tensor rows_grad = grad.narrow(0, offsets[g], count);
    const at::Tensor rows_in = x.narrow(0, offsets[g], count);
    if (count > 0 && output_mask[0] && grad_x_chosen[g] == gemm::GroupProduct::kGemm) {
      // d x = d y @ W^T: weight[g] read the other way round from the forward product.
      pieces.add(grad_x.narrow(0, offsets[g], count), rows_grad, right_factor(weight, g, !weight_transposed),
                 at::Tensor());
    }
    if (output_mask[1]) {
      // d W has weight[g]'s layout: [K, O] = x^T dy, or [O, K] = dy^T x.  A group
      // without rows contributes nothing (a zero gradient).
      at::Tensor dw = grad_weight.select(0, g);
      if (count == 0) {
        dw.zero_();
      } else if (weight_transposed) {
        pieces.add(dw, rows_grad.t(), rows_in, at::Tensor());
      } else {
        pieces.add(dw, rows_in.t(), rows_grad, at::Tensor());
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
  pieces.run();
  return {grad_x, grad_weight, grad_bias};
}

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("grouped_linear", &grouped_linear_cpu);
  m.impl("grouped_linear_backward", &grouped_linear_backward_cpu);
}

}  // namespace ops
}  // namespace tutel
