// kernels/cumsum.cu on the CPU, launched as csrc/ops/cuda/cumsum_cuda.cpp
// launches it, against csrc/core's cumsum_sub_one: bit for bit.
#include <cstdint>
#include <random>
#include <tuple>
#include <type_traits>
#include <vector>

#include "core/cumsum.h"
#include "harness.h"
#include "../../../kernels/cumsum.cu"

namespace {

using namespace kernels_on_cpu;

// csrc/core's input and output types for this variant's mask_t / sum_t.
#if defined(TUTEL_MASK_BOOL)
using CoreIn = bool;
#elif defined(TUTEL_MASK_INT64)
using CoreIn = int64_t;  // mask_t is long long
#else
using CoreIn = mask_t;
#endif
using CoreOut = std::conditional_t<std::is_integral<sum_t>::value, int64_t, sum_t>;
static_assert(sizeof(CoreIn) == sizeof(mask_t) && sizeof(CoreOut) == sizeof(sum_t),
              "the core reads and writes the kernels' layouts");

// Values whose sums are exact in every variant (0/1 for bool).
std::vector<mask_t> random_mask(int64_t n, std::mt19937& rng) {
#if defined(TUTEL_MASK_BOOL)
  std::uniform_int_distribution<int> dist(0, 1);
#elif defined(TUTEL_MASK_UINT8)
  std::uniform_int_distribution<int> dist(0, 3);
#else
  std::uniform_int_distribution<int> dist(-2, 3);
#endif
  std::vector<mask_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = mask_t(dist(rng));
  return v;
}

// What cumsum_sub_one_cuda does, with the emulated kernels.
std::vector<sum_t> cumsum_on_cpu(const std::vector<mask_t>& x, int64_t rows, int64_t cols,
                                 const LaunchOptions& options) {
  std::vector<sum_t> out = garbage<sum_t>(rows * cols);
  if (rows == 0 || cols == 0) return out;
  const tutel::cuda::CumsumPlan plan = tutel::cuda::plan_cumsum(rows, cols);
  std::vector<sum_t> totals = garbage<sum_t>(plan.chunks * cols);
  TUTEL_EMULATED_LAUNCH(cumsum_chunk_totals, plan.chunk_grid, options, x.data(), rows, cols,
                        plan.chunk_rows, totals.data());
  TUTEL_EMULATED_LAUNCH(cumsum_chunk_offsets, plan.offsets_grid, options, totals.data(), plan.chunks, cols);
  TUTEL_EMULATED_LAUNCH(cumsum_chunk_scan, plan.chunk_grid, options, x.data(), rows, cols, plan.chunk_rows,
                        totals.data(), out.data());
  return out;
}

class CumsumCu : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(CumsumCu, MatchesCoreBitForBit) {
  const int64_t rows = std::get<0>(GetParam()), cols = std::get<1>(GetParam());
  std::mt19937 rng(unsigned(rows * 131 + cols));
  const std::vector<mask_t> x = random_mask(rows * cols, rng);
  std::vector<sum_t> want(static_cast<size_t>(rows * cols));
  tutel::core::cumsum_sub_one<CoreIn, CoreOut>(reinterpret_cast<const CoreIn*>(x.data()), rows, cols,
                                               reinterpret_cast<CoreOut*>(want.data()));
  for (const LaunchOptions& options : schedules_for_case(int(rows + cols)))
    EXPECT_TRUE(same_bits(cumsum_on_cpu(x, rows, cols, options), want))
        << "schedule " << int(options.schedule);
}

// 1 and several chunks of 128 rows, 1 and 2 blocks of columns, empty shapes.
INSTANTIATE_TEST_SUITE_P(Shapes, CumsumCu,
                         ::testing::Values(std::make_tuple(0, 3), std::make_tuple(5, 0), std::make_tuple(1, 1),
                                           std::make_tuple(7, 3), std::make_tuple(129, 5),
                                           std::make_tuple(300, 257), std::make_tuple(1, 300),
                                           std::make_tuple(385, 33)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "x" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
