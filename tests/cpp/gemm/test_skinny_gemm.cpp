// Skinny products: the portable, AVX2 and AVX-512 kernels (those this CPU has) against double
// sums, for both matrix layouts, every storage type, odd sizes, strides and output ranges.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "gemm/skinny_gemm.h"
#include "../storage_values.h"

using namespace tutel::gemm;
using tutel_test::bits_of;
using tutel_test::unit_rounding;
using tutel_test::value;

namespace {

struct Case {
  int64_t rows, inner, outputs;
};

const Case kCases[] = {{1, 1, 1},   {1, 16, 4},  {2, 15, 3},  {3, 17, 33}, {1, 33, 16},
                       {5, 64, 65}, {2, 100, 31}, {7, 48, 130}, {4, 8, 9}, {3, 70, 600},
                       {1, 70, 600}, {2, 9, 300},
                       // long matrix rows (4 of them over 16 KiB in every type): the 2 x 4 blocks from 4 rows, odd
                       // row and output counts, a k tail
                       {3, 2100, 5}, {4, 2067, 6}, {7, 4099, 9}, {9, 2048, 3},
                       // rows of a page or more with 1-3 token rows: four matrix rows per pass (shorter rows
                       // go one by one, as do 16-bit ones with up to 4 token rows)
                       {1, 1030, 19}, {2, 2048, 17}, {3, 1100, 10},
                       // rows of exactly 4 KiB in float32 (16 KiB for four): the 2 x 4 blocks from 4 token rows
                       {4, 1024, 7}, {6, 1024, 5},
                       // short rows, 4+ token rows: one matrix row by four token rows, with a k tail
                       {4, 37, 12}, {9, 100, 20},
                       // rows over 32 KiB in every type (prefetched one row ahead) and no inner elements
                       {2, 16400, 3}, {5, 16401, 4}, {2, 0, 5}};

template <class T>
void check_kernel(SkinnyKernel<T> kernel, WeightLayout layout, const Case& c, bool with_bias, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  // Row strides wider than the rows, so a kernel that assumes packed rows reads the wrong values.
  const int64_t x_stride = c.inner + 3, y_stride = c.outputs + 5;
  const int64_t w_rows = layout == WeightLayout::kOutputsByInner ? c.outputs : c.inner;
  const int64_t w_cols = layout == WeightLayout::kOutputsByInner ? c.inner : c.outputs;
  const int64_t w_stride = w_cols + 2;
  std::vector<T> x(c.rows * x_stride), w(w_rows * w_stride), bias(c.outputs), y(c.rows * y_stride);
  for (auto& v : x) v = Scalar<T>::store(dist(rng));
  for (auto& v : w) v = Scalar<T>::store(dist(rng));
  for (auto& v : bias) v = Scalar<T>::store(dist(rng));
  const T sentinel = Scalar<T>::store(12345.f);
  for (auto& v : y) v = sentinel;
  SkinnyProduct<T> p{x.data(), x_stride, w.data(), w_stride, with_bias ? bias.data() : nullptr, y.data(), y_stride,
                     c.rows};
  // Two ranges that meet in the middle, as two threads' tiles would.
  const int64_t middle = c.outputs / 2;
  kernel(p, c.inner, 0, middle);
  kernel(p, c.inner, middle, c.outputs);
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t o = 0; o < y_stride; ++o) {
      const double got = value(y[r * y_stride + o]);
      if (o >= c.outputs) {
        EXPECT_EQ(got, value(sentinel)) << "wrote past the outputs";
        continue;
      }
      double sum = with_bias ? value(bias[o]) : 0.0, scale = with_bias ? std::fabs(sum) : 0.0;
      for (int64_t k = 0; k < c.inner; ++k) {
        const double wk = layout == WeightLayout::kOutputsByInner ? value(w[o * w_stride + k]) : value(w[k * w_stride + o]);
        sum += value(x[r * x_stride + k]) * wk;
        scale += std::fabs(value(x[r * x_stride + k]) * wk);
      }
      const double bound = unit_rounding(T()) * std::fabs(sum) + (c.inner + 2) * std::ldexp(1.0, -24) * scale;
      EXPECT_LE(std::fabs(got - sum), bound) << "rows " << c.rows << " inner " << c.inner << " outputs "
                                             << c.outputs << " at (" << r << ", " << o << ")";
    }
  }
}

template <class T>
void check_kernels(const SkinnyKernels<T>& kernels) {
  std::mt19937 rng(17);
  for (const Case& c : kCases) {
    for (bool with_bias : {false, true}) {
      check_kernel<T>(kernels.outputs_by_inner, WeightLayout::kOutputsByInner, c, with_bias, rng);
      check_kernel<T>(kernels.inner_by_outputs, WeightLayout::kInnerByOutputs, c, with_bias, rng);
    }
  }
}

template <class T>
class SkinnyGemmTest : public ::testing::Test {};

using StorageTypes = ::testing::Types<float, double, bfloat16, float16>;
TYPED_TEST_SUITE(SkinnyGemmTest, StorageTypes);

TYPED_TEST(SkinnyGemmTest, PortableKernelsMatchDoubleSums) { check_kernels(portable_skinny_kernels<TypeParam>()); }

// A vectorised kernel set against double sums: none for double (it runs the portable kernels),
// skipped where this CPU lacks `what`.
template <class T>
void check_vectorised(const SkinnyKernels<T>* kernels, const char* what) {
  if (std::is_same<T, double>::value) {
    EXPECT_EQ(kernels, nullptr) << "double runs the portable kernels";
    return;
  }
  if (kernels == nullptr) GTEST_SKIP() << "this CPU has no " << what;
  check_kernels(*kernels);
}

TYPED_TEST(SkinnyGemmTest, Avx2KernelsMatchDoubleSums) {
  check_vectorised(avx2_skinny_kernels<TypeParam>(), "AVX2 + FMA");
}

TYPED_TEST(SkinnyGemmTest, Avx512KernelsMatchDoubleSums) {
  check_vectorised(avx512_skinny_kernels<TypeParam>(), "AVX-512");
}

// What a CPU with AVX-512 but without AVX512-BF16 runs for bfloat16 (the same kernels as above
// for the other types).
TYPED_TEST(SkinnyGemmTest, Avx512WideningKernelsMatchDoubleSums) {
  check_vectorised(avx512_widening_skinny_kernels<TypeParam>(), "AVX-512");
}

// Products whose float sums are exact (x selects one matrix element, the bias adds a value within
// a few binades of it) but fall between two values of T, two thirds of them ties, and a NaN bias
// with a payload: every kernel must store what Scalar<T>::store makes of the sum, so 16-bit
// results round to nearest even and NaN is written as scalar.h writes it.
template <class T>
void check_rounding(const SkinnyKernels<T>& kernels) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> large(1.f, 2.f), small(1.f / 1024, 1.f / 64);
  const int64_t rows = 5, inner = 20, outputs = 37;
  // Half a unit in the last place of T in [1, 2): sums that end in it are ties (for float the add
  // itself rounds, alike in kernel and reference).
  const float half_ulp = float(unit_rounding(T()));
  // A NaN with every payload bit set: rounding its bits as a number would carry into the sign.
  T payload_nan;
  const uint64_t nan_bits = sizeof(T) == 2 ? 0x7fffu : sizeof(T) == 4 ? 0x7fffffffu : 0x7fffffffffffffffu;
  std::memcpy(&payload_nan, &nan_bits, sizeof(T));
  for (WeightLayout layout : {WeightLayout::kOutputsByInner, WeightLayout::kInnerByOutputs}) {
    const bool by_inner = layout == WeightLayout::kOutputsByInner;
    std::vector<T> x(rows * inner, Scalar<T>::store(0.f)), w(outputs * inner), bias(outputs), y(rows * outputs);
    for (int64_t r = 0; r < rows; ++r) x[r * inner + r] = Scalar<T>::store(1.f);  // row r picks k = r
    for (auto& v : w) v = Scalar<T>::store(large(rng));
    for (int64_t o = 0; o < outputs; ++o)
      bias[o] = Scalar<T>::store(o % 3 == 0 ? small(rng) : half_ulp * float(o % 3 == 1 ? 1 : 3));
    bias[4] = payload_nan;
    const int64_t w_stride = by_inner ? inner : outputs;
    const SkinnyKernel<T> kernel = by_inner ? kernels.outputs_by_inner : kernels.inner_by_outputs;
    kernel({x.data(), inner, w.data(), w_stride, bias.data(), y.data(), outputs, rows}, inner, 0, outputs);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < outputs; ++o) {
        const T picked = by_inner ? w[o * inner + r] : w[r * outputs + o];
        const T expected = Scalar<T>::store(Scalar<T>::load(picked) + Scalar<T>::load(bias[o]));
        ASSERT_EQ(bits_of(y[r * outputs + o]), bits_of(expected))
            << (by_inner ? "[O, K]" : "[K, O]") << " row " << r << " output " << o;
      }
  }
}

TYPED_TEST(SkinnyGemmTest, EveryKernelRoundsItsSumsAsScalarStores) {
  check_rounding(portable_skinny_kernels<TypeParam>());
  for (const SkinnyKernels<TypeParam>* kernels :
       {avx2_skinny_kernels<TypeParam>(), avx512_skinny_kernels<TypeParam>(), avx512_widening_skinny_kernels<TypeParam>()})
    if (kernels != nullptr) check_rounding(*kernels);
}

// Each token row of a product multiplied with 12 others and alone: bit for bit the same results.
template <class T>
void check_rows_alone(const SkinnyKernels<T>& kernels) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (WeightLayout layout : {WeightLayout::kOutputsByInner, WeightLayout::kInnerByOutputs}) {
    for (int64_t inner : {64, 77, 1500, 5000}) {
      const int64_t rows = 13, outputs = 37;
      std::vector<T> x(rows * inner), w(outputs * inner), together(rows * outputs), alone(outputs);
      for (auto& v : x) v = Scalar<T>::store(dist(rng));
      for (auto& v : w) v = Scalar<T>::store(dist(rng));
      const bool by_inner = layout == WeightLayout::kOutputsByInner;
      const SkinnyKernel<T> kernel = by_inner ? kernels.outputs_by_inner : kernels.inner_by_outputs;
      const int64_t w_stride = by_inner ? inner : outputs;
      kernel({x.data(), inner, w.data(), w_stride, nullptr, together.data(), outputs, rows}, inner, 0, outputs);
      for (int64_t r = 0; r < rows; ++r) {
        kernel({x.data() + r * inner, inner, w.data(), w_stride, nullptr, alone.data(), outputs, 1}, inner, 0, outputs);
        for (int64_t o = 0; o < outputs; ++o)
          ASSERT_EQ(value(alone[o]), value(together[r * outputs + o]))
              << (by_inner ? "[O, K]" : "[K, O]") << " inner " << inner << " row " << r << " output " << o;
      }
    }
  }
}

// The AVX-512 kernels sum each output in one chain, in the same order whatever block its token row
// falls in (and the [K, O] strips in the order of the AVX2 stream kernel they leave 1-2 token rows
// to), so a token row's results do not depend on how many rows its expert has.  Inner sizes with
// and without a tail, in one chunk of k and in several.
TYPED_TEST(SkinnyGemmTest, Avx512RowsDoNotDependOnTheirNeighbours) {
  if (std::is_same<TypeParam, double>::value) return;  // no vectorised kernels (checked above)
  for (const SkinnyKernels<TypeParam>* kernels :
       {avx512_skinny_kernels<TypeParam>(), avx512_widening_skinny_kernels<TypeParam>()}) {
    if (kernels == nullptr) GTEST_SKIP() << "this CPU has no AVX-512";
    check_rows_alone(*kernels);
  }
}

// The widths the kernel sets report, which decide where PyTorch's GEMM takes over.
TYPED_TEST(SkinnyGemmTest, KernelSetsReportTheirVectorWidths) {
  const SkinnyKernels<TypeParam>& portable = portable_skinny_kernels<TypeParam>();
  EXPECT_EQ(portable.outputs_by_inner_bits, 0);
  EXPECT_EQ(portable.inner_by_outputs_bits, 0);
  if (const SkinnyKernels<TypeParam>* avx2 = avx2_skinny_kernels<TypeParam>()) {
    EXPECT_EQ(avx2->outputs_by_inner_bits, 256);
    EXPECT_EQ(avx2->inner_by_outputs_bits, 256);
  }
  for (const SkinnyKernels<TypeParam>* avx512 :
       {avx512_skinny_kernels<TypeParam>(), avx512_widening_skinny_kernels<TypeParam>()}) {
    if (avx512 == nullptr) continue;
    EXPECT_EQ(avx512->outputs_by_inner_bits, 512);
    EXPECT_EQ(avx512->inner_by_outputs_bits, 512);
  }
  const SkinnyKernels<TypeParam>* best = avx512_skinny_kernels<TypeParam>();
  if (best == nullptr) best = avx2_skinny_kernels<TypeParam>();
  EXPECT_EQ(&skinny_kernels<TypeParam>(), best != nullptr ? best : &portable) << "the widest kernels this CPU has";
}

// Runs skinny_products on products with the given row counts and checks every output.
template <class T>
void check_driver(const std::vector<int64_t>& rows, WeightLayout layout) {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.f, 1.f);
  const int64_t inner = 40, outputs = 150;
  const bool by_inner = layout == WeightLayout::kOutputsByInner;
  std::vector<std::vector<T>> xs, ws, ys;
  std::vector<SkinnyProduct<T>> products;
  for (int64_t n : rows) {
    xs.emplace_back(n * inner);
    ws.emplace_back(outputs * inner);
    ys.emplace_back(n * outputs);
    for (auto& v : xs.back()) v = Scalar<T>::store(dist(rng));
    for (auto& v : ws.back()) v = Scalar<T>::store(dist(rng));
  }
  for (size_t i = 0; i < xs.size(); ++i)
    products.push_back({xs[i].data(), inner, ws[i].data(), by_inner ? inner : outputs, nullptr, ys[i].data(),
                        outputs, rows[i]});
  skinny_products(products, inner, outputs, layout);
  for (size_t i = 0; i < xs.size(); ++i) {
    for (int64_t r = 0; r < rows[i]; ++r) {
      for (int64_t o = 0; o < outputs; ++o) {
        double sum = 0, scale = 0;
        for (int64_t k = 0; k < inner; ++k) {
          const double term = value(xs[i][r * inner + k]) * value(ws[i][by_inner ? o * inner + k : k * outputs + o]);
          sum += term;
          scale += std::fabs(term);
        }
        EXPECT_LE(std::fabs(value(ys[i][r * outputs + o]) - sum),
                  unit_rounding(T()) * std::fabs(sum) + (inner + 2) * std::ldexp(1.0, -24) * scale)
            << "product " << i << " row " << r << " output " << o << (by_inner ? " [O, K]" : " [K, O]");
      }
    }
  }
}

TYPED_TEST(SkinnyGemmTest, DriverRunsEveryProductAndTile) {
  // 150 outputs: three 64-output tiles (the last partial) of [O, K]; [K, O] tiles as wide as the
  // thread count allows (a lone product split across threads: 16-output blocks plus a remainder).
  for (WeightLayout layout : {WeightLayout::kOutputsByInner, WeightLayout::kInnerByOutputs}) {
    check_driver<TypeParam>({1, 4, 2}, layout);
    check_driver<TypeParam>({1, 2, 1}, layout);
    check_driver<TypeParam>({2}, layout);
  }
}

}  // namespace
