// AMX tile products (gemm/tile_gemm.h), both matrix layouts, against double sums: several products per call, odd row,
// inner and output counts (partial tiles and steps of every kind), strides wider than the rows,
// bias, no inner values; a token row's results alone and among others; NaN stores and where a NaN in
// the matrix reaches.  Skipped where the CPU (or the operating system) gives no AMX tiles.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "gemm/tile_gemm.h"
#include "../storage_values.h"

using namespace tutel::gemm;
using tutel_test::bits_of;
using tutel_test::unit_rounding;
using tutel_test::value;

namespace {

// One product's operands, with row strides wider than the rows so that a kernel assuming packed
// rows reads the wrong values, and a sentinel in every element of y it must not write.
struct Operands {
  WeightLayout layout;
  int64_t rows, inner, outputs, x_stride, w_stride, y_stride;
  std::vector<bfloat16> x, w, bias, y;

  Operands(WeightLayout layout_, int64_t rows_, int64_t inner_, int64_t outputs_, std::mt19937& rng)
      : layout(layout_), rows(rows_), inner(inner_), outputs(outputs_), x_stride(inner_ + 3),
        w_stride((by_inner() ? inner_ : outputs_) + 2), y_stride(outputs_ + 5), x(rows_ * x_stride),
        w((by_inner() ? outputs_ : inner_) * w_stride), bias(outputs_), y(rows_ * y_stride) {
    std::normal_distribution<float> dist(0.f, 1.f);
    for (auto& v : x) v = Scalar<bfloat16>::store(dist(rng));
    for (auto& v : w) v = Scalar<bfloat16>::store(dist(rng));
    for (auto& v : bias) v = Scalar<bfloat16>::store(dist(rng));
    for (auto& v : y) v = sentinel();
  }
  bool by_inner() const { return layout == WeightLayout::kOutputsByInner; }
  double matrix(int64_t o, int64_t k) const { return value(by_inner() ? w[o * w_stride + k] : w[k * w_stride + o]); }
  // The matrix cut to end at its last value, so that nothing past it belongs to it.
  void trim_matrix() { w.resize(by_inner() ? (outputs - 1) * w_stride + inner : (inner - 1) * w_stride + outputs); }
  static bfloat16 sentinel() { return Scalar<bfloat16>::store(12345.f); }
  SkinnyProduct<bfloat16> product(bool with_bias) {
    return {x.data(), x_stride, w.data(), w_stride, with_bias ? bias.data() : nullptr, y.data(), y_stride, rows};
  }
  // This product alone through tile_products.
  void run_alone(bool with_bias) {
    const std::vector<SkinnyProduct<bfloat16>> products{product(with_bias)};
    tile_products(products, inner, outputs, layout);
  }
};

void expect_double_sums(const Operands& a, bool with_bias) {
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t o = 0; o < a.y_stride; ++o) {
      const double got = value(a.y[r * a.y_stride + o]);
      if (o >= a.outputs) {
        EXPECT_EQ(got, value(Operands::sentinel())) << "wrote past the outputs";
        continue;
      }
      double sum = with_bias ? value(a.bias[o]) : 0.0, scale = std::fabs(sum);
      for (int64_t k = 0; k < a.inner; ++k) {
        const double term = value(a.x[r * a.x_stride + k]) * a.matrix(o, k);
        sum += term;
        scale += std::fabs(term);
      }
      const double bound = unit_rounding(bfloat16()) * std::fabs(sum) + (a.inner + 2) * std::ldexp(1.0, -24) * scale;
      ASSERT_LE(std::fabs(got - sum), bound) << (a.by_inner() ? "[O, K]" : "[K, O]") << " rows " << a.rows << " inner " << a.inner << " outputs " << a.outputs
                                             << " at (" << r << ", " << o << ")";
    }
  }
}

bool skip_without_tiles() { return !tile_products_available(); }

const WeightLayout kLayouts[] = {WeightLayout::kOutputsByInner, WeightLayout::kInnerByOutputs};

}  // namespace

TEST(TileGemm, ProductsMatchDoubleSums) {
  if (skip_without_tiles()) GTEST_SKIP() << "this CPU or OS gives no AMX tiles";
  std::mt19937 rng(23);
  // inner: one value, a step's tail (of 16 or 32 values), exact steps, a chunk of in-place steps and
  // one past it, several steps with a tail, none
  // outputs: partial A tiles, exact tiles, a tile pair and a lone tile, several 64-output items
  for (WeightLayout layout : kLayouts) {
    for (int64_t inner : {1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 100, 1029, 0}) {
      for (int64_t outputs : {1, 15, 16, 17, 48, 65, 130, 300}) {
        for (bool with_bias : {false, true}) {
          // one to several blocks of 16 token rows, pairs and lone blocks, partial blocks; [K, O]
          // matrices read in place (up to 16 rows) and interleaved (more), [O, K] ones read in place
          // (up to 127 rows) and packed (from 128) in the same call
          std::vector<Operands> operands;
          for (int64_t rows : {1, 7, 16, 17, 32, 33, 64, 70, 128})
            operands.emplace_back(layout, rows, inner, outputs, rng);
          std::vector<SkinnyProduct<bfloat16>> products;
          for (Operands& a : operands) products.push_back(a.product(with_bias));
          tile_products(products, inner, outputs, layout);
          for (const Operands& a : operands) expect_double_sums(a, with_bias);
        }
      }
    }
  }
}

// Many token rows: [O, K] matrices packed, past 256 rows in two spans of rows, the last one partial;
// beside them a product of few rows in the same call.
TEST(TileGemm, ManyRowsMatchDoubleSums) {
  if (skip_without_tiles()) GTEST_SKIP() << "this CPU or OS gives no AMX tiles";
  std::mt19937 rng(29);
  for (WeightLayout layout : kLayouts) {
    for (int64_t inner : {17, 65, 100}) {
      for (int64_t outputs : {17, 48, 130}) {
        for (bool with_bias : {false, true}) {
          std::vector<Operands> operands;
          for (int64_t rows : {145, 300, 5}) operands.emplace_back(layout, rows, inner, outputs, rng);
          std::vector<SkinnyProduct<bfloat16>> products;
          for (Operands& a : operands) products.push_back(a.product(with_bias));
          tile_products(products, inner, outputs, layout);
          for (const Operands& a : operands) expect_double_sums(a, with_bias);
        }
      }
    }
  }
}

// Values that end where an inaccessible page begins: a read past them faults.
class GuardedValues {
 public:
  explicit GuardedValues(const std::vector<bfloat16>& values) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE)), bytes = values.size() * sizeof(bfloat16);
    size_ = (bytes + page - 1) / page * page + page;
    base_ = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    mprotect(static_cast<char*>(base_) + size_ - page, page, PROT_NONE);
    data_ = reinterpret_cast<bfloat16*>(static_cast<char*>(base_) + size_ - page - bytes);
    std::memcpy(data_, values.data(), bytes);
  }
  ~GuardedValues() { munmap(base_, size_); }
  const bfloat16* data() const { return data_; }

 private:
  void* base_;
  size_t size_;
  bfloat16* data_;
};

// The partial tiles (the last matrix rows, the last step's values, the last token rows) read
// nothing past the operands: matrix and token rows placed right before an inaccessible page.
TEST(TileGemm, ReadsNothingPastTheOperands) {
  if (skip_without_tiles()) GTEST_SKIP() << "this CPU or OS gives no AMX tiles";
  std::mt19937 rng(31);
  for (WeightLayout layout : kLayouts) {
    for (auto [rows, outputs] : {std::pair<int64_t, int64_t>{19, 17}, {19, 40}, {130, 17}, {130, 40}}) {
      Operands a(layout, rows, 45, outputs, rng);
      a.trim_matrix();
      a.x.resize((a.rows - 1) * a.x_stride + a.inner);
      const GuardedValues w(a.w), x(a.x);
      SkinnyProduct<bfloat16> p = a.product(true);
      p.w = w.data();
      p.x = x.data();
      std::vector<SkinnyProduct<bfloat16>> products{p};
      tile_products(products, a.inner, a.outputs, layout);
      expect_double_sums(a, true);
    }
  }
}

// [K, O] matrices wider than one work item (1024 outputs) split into several, a partial one last.
TEST(TileGemm, WideMatricesSplitIntoItems) {
  if (skip_without_tiles()) GTEST_SKIP() << "this CPU or OS gives no AMX tiles";
  std::mt19937 rng(41);
  for (WeightLayout layout : kLayouts) {
    Operands a(layout, 3, 40, 2100, rng);
    a.run_alone(true);
    expect_double_sums(a, true);
  }
}

// Each token row's sums run the same steps in the same order whichever block of 16 it sits in, so
// a row computed alone gives the bits it gives among 40 or 140 others, across the two ways of
// reading each layout: [K, O] alone in place, among others interleaved (the spread rows' zeros add
// nothing); [O, K] alone in place, among 140 packed (the matrix as B tiles instead of A).
TEST(TileGemm, RowAloneMatchesRowAmongOthersBitwise) {
  if (skip_without_tiles()) GTEST_SKIP() << "this CPU or OS gives no AMX tiles";
  std::mt19937 rng(5);
  for (WeightLayout layout : kLayouts) {
    for (int64_t count : {41, 141}) {
      Operands many(layout, count, 300, 70, rng);
      many.run_alone(true);
      for (int64_t r : {int64_t(0), int64_t(15), int64_t(16), int64_t(33), count - 1}) {
        Operands alone(layout, 1, many.inner, many.outputs, rng);
        alone.w = many.w;
        alone.bias = many.bias;
        for (int64_t k = 0; k < many.inner; ++k) alone.x[k] = many.x[r * many.x_stride + k];
        alone.run_alone(true);
        for (int64_t o = 0; o < many.outputs; ++o)
          ASSERT_EQ(bits_of(alone.y[o]), bits_of(many.y[r * many.y_stride + o]))
              << "rows " << count << ", row " << r << " output " << o;
      }
    }
  }
}

// A NaN in a token row makes every output of that row NaN, stored as Scalar<bfloat16>::store
// stores it, in whole 16-output vectors and in the scalar tail alike.
TEST(TileGemm, NanStoresMatchScalarStores) {
  if (skip_without_tiles()) GTEST_SKIP() << "this CPU or OS gives no AMX tiles";
  std::mt19937 rng(9);
  const bfloat16 nan = Scalar<bfloat16>::store(std::numeric_limits<float>::quiet_NaN());
  for (WeightLayout layout : kLayouts) {
    Operands a(layout, 3, 40, 21, rng);
    a.x[1 * a.x_stride + 7] = nan;
    a.run_alone(false);
    for (int64_t o = 0; o < a.outputs; ++o) {
      EXPECT_EQ(bits_of(a.y[1 * a.y_stride + o]), bits_of(nan)) << "output " << o;
      EXPECT_FALSE(std::isnan(value(a.y[o]))) << "output " << o << " of a row without NaN";
    }
  }
}

// A NaN in the matrix makes its output NaN in every token row and leaves every other output finite,
// except (for [K, O] matrices read in place, up to 16 token rows) the other output of its pair,
// 2 n and 2 n + 1, which the spread token rows multiply by zero: NaN too.
TEST(TileGemm, NanInTheMatrixReachesOnlyItsOutputAndItsPair) {
  if (skip_without_tiles()) GTEST_SKIP() << "this CPU or OS gives no AMX tiles";
  std::mt19937 rng(13);
  const bfloat16 nan = Scalar<bfloat16>::store(std::numeric_limits<float>::quiet_NaN());
  for (WeightLayout layout : kLayouts) {
    for (int64_t rows : {3, 16, 40, 140}) {  // [K, O]: in place, in place, interleaved; [O, K] packed from 128
      Operands a(layout, rows, 40, 70, rng);
      const int64_t column = 37, k = 11;
      (a.by_inner() ? a.w[column * a.w_stride + k] : a.w[k * a.w_stride + column]) = nan;
      a.run_alone(true);
      const bool pair_too = !a.by_inner() && rows <= 16;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = 0; o < a.outputs; ++o) {
          const bool nan_expected = o == column || (pair_too && o == (column ^ 1));
          EXPECT_EQ(std::isnan(value(a.y[r * a.y_stride + o])), nan_expected)
              << (a.by_inner() ? "[O, K]" : "[K, O]") << " rows " << rows << " at (" << r << ", " << o << ")";
        }
      }
    }
  }
}
