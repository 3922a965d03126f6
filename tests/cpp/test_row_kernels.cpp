// Row kernels: the portable loops against double-precision sums, and the
// vectorised kernels (when this CPU has them) bitwise against the portable ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/row_kernels.h"
#include "storage_values.h"

using namespace tutel::core;

using tutel_test::bits_of;

namespace {

// Row lengths around the vector widths (8 lanes, 32-element blocks) and odd sizes.
const int64_t kLengths[] = {0, 1, 7, 8, 9, 31, 32, 33, 63, 100, 515};

template <class T>
std::vector<T> random_row(int64_t M, std::mt19937& rng, bool specials) {
  std::normal_distribution<float> dist(0.f, 3.f);
  std::vector<T> row(M);
  for (int64_t m = 0; m < M; ++m) {
    float value = dist(rng);
    if (specials) {
      switch (rng() % 12) {
        case 0: value = std::numeric_limits<float>::quiet_NaN(); break;
        case 1: value = -std::numeric_limits<float>::infinity(); break;
        case 2: value = 1e-41f; break;                   // float subnormal
        case 3: value = std::ldexp(1.0f, -20) * 0.75f; break;  // fp16 subnormal
        case 4: value = 65519.0f; break;                 // rounds to fp16's largest finite
        default: break;
      }
    }
    row[m] = Scalar<T>::store(value);
  }
  return row;
}

// n random rows with their pointers and random weights in [-weight_range, weight_range].
template <class T>
struct RowSet {
  std::vector<std::vector<T>> rows;
  std::vector<const T*> pointers;
  std::vector<acc_t<T>> weights;
};

template <class T>
RowSet<T> random_rows(int n, int64_t M, std::mt19937& rng, bool specials, float weight_range) {
  std::uniform_real_distribution<float> weight(-weight_range, weight_range);
  RowSet<T> set;
  for (int i = 0; i < n; ++i) {
    set.rows.push_back(random_row<T>(M, rng, specials));
    set.weights.push_back(acc_t<T>(weight(rng)));
  }
  for (auto& row : set.rows) set.pointers.push_back(row.data());
  return set;
}

// Equal bits, except that any two NaNs match: which NaN an operation returns
// (sign, payload) depends on operand order, which the compiler may swap.
template <class T>
void expect_same_bits(const std::vector<T>& a, const std::vector<T>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t m = 0; m < a.size(); ++m) {
    if (std::isnan(Scalar<T>::load(a[m])) && std::isnan(Scalar<T>::load(b[m]))) continue;
    ASSERT_EQ(bits_of(a[m]), bits_of(b[m])) << what << " element " << m;
  }
}

template <class T>
class RowKernelTypes : public ::testing::Test {};

using Types = ::testing::Types<float, double, bfloat16, float16>;
TYPED_TEST_SUITE(RowKernelTypes, Types);

TYPED_TEST(RowKernelTypes, PortableWeightedSumMatchesDoubleSum) {
  using T = TypeParam;
  const RowKernels<T>& kernels = portable_row_kernels<T>();
  std::mt19937 rng(3);
  for (int64_t M : kLengths) {
    for (int n = 1; n <= 5; ++n) {
      RowSet<T> set = random_rows<T>(n, M, rng, false, 1.5f);
      const auto& rows = set.rows;
      const auto& pointers = set.pointers;
      const auto& weights = set.weights;
      std::vector<T> out(M);
      kernels.weighted_sum(out.data(), pointers.data(), weights.data(), n, M);
      for (int64_t m = 0; m < M; ++m) {
        double expected = 0, magnitude = 0;
        for (int i = 0; i < n; ++i) {
          double term = double(weights[i]) * double(Scalar<T>::load(rows[i][m]));
          expected += term;
          magnitude += std::fabs(term);
        }
        double unit = std::is_same<T, double>::value ? 1e-15 : std::is_same<T, float>::value ? 1e-6 : 1e-2;
        EXPECT_NEAR(double(Scalar<T>::load(out[m])), expected, unit * (magnitude + 1e-30) * (n + 1))
            << "M=" << M << " n=" << n << " m=" << m;
      }
    }
  }
}

TYPED_TEST(RowKernelTypes, PortableDotMatchesDoubleDot) {
  using T = TypeParam;
  const RowKernels<T>& kernels = portable_row_kernels<T>();
  std::mt19937 rng(5);
  for (int64_t M : kLengths) {
    std::vector<T> a = random_row<T>(M, rng, false), b = random_row<T>(M, rng, false);
    double expected = 0, magnitude = 0;
    for (int64_t m = 0; m < M; ++m) {
      double term = double(Scalar<T>::load(a[m])) * double(Scalar<T>::load(b[m]));
      expected += term;
      magnitude += std::fabs(term);
    }
    double unit = std::is_same<T, double>::value ? 1e-15 : 1e-6;
    EXPECT_NEAR(double(kernels.dot(a.data(), b.data(), M)), expected, unit * (magnitude + 1e-30) * 8) << M;
  }
}

// float64 has no vectorised kernels (it always runs the portable ones), so it is not listed.
template <class T>
class VectorisedRowKernelTypes : public ::testing::Test {};

using VectorisedTypes = ::testing::Types<float, bfloat16, float16>;
TYPED_TEST_SUITE(VectorisedRowKernelTypes, VectorisedTypes);

TYPED_TEST(VectorisedRowKernelTypes, EqualPortableBitwise) {
  using T = TypeParam;
  using A = acc_t<T>;
  const RowKernels<T>* vectorised = avx2_row_kernels<T>();
  if (vectorised == nullptr) GTEST_SKIP() << "this CPU or build has no AVX2 + F16C kernels";
  const RowKernels<T>& portable = portable_row_kernels<T>();
  std::mt19937 rng(11);
  for (int64_t M : kLengths) {
    for (bool specials : {false, true}) {
      for (int n = 1; n <= 5; ++n) {
        RowSet<T> set = random_rows<T>(n, M, rng, specials, 2.f);
        const auto& pointers = set.pointers;
        const auto& weights = set.weights;
        for (const A* w : {static_cast<const A*>(nullptr), static_cast<const A*>(weights.data())}) {
          std::vector<T> expected(M), got(M);
          portable.weighted_sum(expected.data(), pointers.data(), w, n, M);
          vectorised->weighted_sum(got.data(), pointers.data(), w, n, M);
          expect_same_bits(expected, got, "weighted_sum");
        }
      }
      std::vector<T> a = random_row<T>(M, rng, specials), b = random_row<T>(M, rng, specials);
      A expected = portable.dot(a.data(), b.data(), M), got = vectorised->dot(a.data(), b.data(), M);
      if (std::isnan(expected)) {
        EXPECT_TRUE(std::isnan(got)) << M;
      } else {
        EXPECT_EQ(bits_of(expected), bits_of(got)) << "dot, M=" << M;
      }
    }
  }
}

// Every 16-bit pattern, scaled by weights that make rounding and overflow
// happen, converts exactly as the scalar rules in scalar.h say.
template <class T>
void check_every_pattern(const RowKernels<T>& kernels) {
  std::vector<T> row(65536);
  for (uint32_t bits = 0; bits < 65536; ++bits) row[bits] = T{uint16_t(bits)};
  for (float w : {1.0f, 0.5f, 0.3f, 3.0f, -1.7f, 1e-3f}) {
    std::vector<T> out(row.size());
    const T* rows[1] = {row.data()};
    kernels.weighted_sum(out.data(), rows, &w, 1, int64_t(row.size()));
    for (uint32_t bits = 0; bits < 65536; ++bits) {
      uint16_t expected = Scalar<T>::store(w * Scalar<T>::load(row[bits])).bits;
      ASSERT_EQ(out[bits].bits, expected) << "pattern " << bits << " weight " << w;
    }
  }
}

TEST(RowKernels, SixteenBitConversionsOfEveryPattern) {
  check_every_pattern(portable_row_kernels<bfloat16>());
  check_every_pattern(portable_row_kernels<float16>());
  if (avx2_row_kernels<bfloat16>() == nullptr) GTEST_SKIP() << "no vectorised kernels on this CPU/build";
  check_every_pattern(*avx2_row_kernels<bfloat16>());
  check_every_pattern(*avx2_row_kernels<float16>());
}

TEST(RowKernels, SelectedKernelsAreTheVectorisedOnesWhenAvailable) {
  const RowKernels<float>* vectorised = avx2_row_kernels<float>();
  const RowKernels<float>& chosen = row_kernels<float>();
  EXPECT_EQ(chosen.weighted_sum, vectorised ? vectorised->weighted_sum : portable_row_kernels<float>().weighted_sum);
  EXPECT_EQ(row_kernels<double>().dot, portable_row_kernels<double>().dot);
}

}  // namespace
