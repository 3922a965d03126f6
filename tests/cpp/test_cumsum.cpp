// cumsum_sub_one against a sequential loop, including shapes split into pieces.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "core/cumsum.h"

using namespace tutel::core;

template <class In, class Out>
void check(int64_t rows, int64_t cols, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(0, 1);
  // std::unique_ptr rather than std::vector: vector<bool> has no data().
  std::unique_ptr<In[]> x(new In[rows * cols]);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = In(dist(rng));
  std::vector<Out> out(rows * cols, Out(42));
  cumsum_sub_one<In, Out>(x.get(), rows, cols, out.data());
  for (int64_t c = 0; c < cols; ++c) {
    Out running = Out(-1);
    for (int64_t r = 0; r < rows; ++r) {
      running += Out(x[r * cols + c]);
      ASSERT_EQ(out[r * cols + c], running) << r << "," << c;
    }
  }
}

TEST(Cumsum, SmallAndLargeShapes) {
  for (auto shape : {std::pair<int64_t, int64_t>{0, 3}, {1, 1}, {37, 5}, {4097, 64}, {200000, 3}, {3, 100000}}) {
    check<int64_t, int64_t>(shape.first, shape.second, 1);
    check<int32_t, int32_t>(shape.first, shape.second, 2);
    check<bool, int64_t>(shape.first, shape.second, 3);
    check<uint8_t, int64_t>(shape.first, shape.second, 4);
    check<float, float>(shape.first, shape.second, 5);
    check<double, double>(shape.first, shape.second, 6);
  }
}
