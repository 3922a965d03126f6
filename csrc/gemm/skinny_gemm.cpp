// Portable skinny products, the run-time choice of kernels, and the parallel driver.
#include "skinny_gemm.h"

#include <algorithm>

#include "../core/parallel.h"
#include "work_balance.h"

namespace tutel {
namespace gemm {

using core::max_parallelism;
using core::parallel_for;
namespace {

template <class T>
void portable_outputs_by_inner(const SkinnyProduct<T>& p, int64_t inner, int64_t o_begin, int64_t o_end) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* x = p.x + r * p.x_stride;
    for (int64_t o = o_begin; o < o_end; ++o) {
      const T* w = p.w + o * p.w_stride;
      A sum = 0;
      for (int64_t k = 0; k < inner; ++k) sum += Scalar<T>::load(x[k]) * Scalar<T>::load(w[k]);
      if (p.bias) sum += Scalar<T>::load(p.bias[o]);
      p.y[r * p.y_stride + o] = Scalar<T>::store(sum);
    }
  }
}

template <class T>
void portable_inner_by_outputs(const SkinnyProduct<T>& p, int64_t inner, int64_t o_begin, int64_t o_end) {
  using A = acc_t<T>;
  constexpr int64_t kBlock = 64;
  A acc[kBlock];
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* x = p.x + r * p.x_stride;
    for (int64_t begin = o_begin; begin < o_end; begin += kBlock) {
      const int64_t len = std::min(kBlock, o_end - begin);
      for (int64_t i = 0; i < len; ++i) acc[i] = p.bias ? Scalar<T>::load(p.bias[begin + i]) : A(0);
      for (int64_t k = 0; k < inner; ++k) {
        const A xk = Scalar<T>::load(x[k]);
        const T* w = p.w + k * p.w_stride + begin;
        for (int64_t i = 0; i < len; ++i) acc[i] += xk * Scalar<T>::load(w[i]);
      }
      for (int64_t i = 0; i < len; ++i) p.y[r * p.y_stride + begin + i] = Scalar<T>::store(acc[i]);
    }
  }
}

// Outputs per parallel work item of the [O, K] layout: enough to amortise a task, few enough that
// a single expert's product (decoding one token) still splits across every thread.
constexpr int64_t kOutputsPerTile = 64;

// Tiles of the [K, O] layout: the widest (a multiple of 16 outputs) that still give every thread
// one, so a task streams whole matrix rows (one contiguous matrix once there are as many
// products as threads).
inline int64_t stream_tile_outputs(size_t products, int64_t outputs) {
  const int64_t threads = max_parallelism();
  const int64_t per_product = std::max<int64_t>(1, (threads + int64_t(products) - 1) / int64_t(products));
  const int64_t tile = (outputs + per_product - 1) / per_product;
  return std::max<int64_t>(16, (tile + 15) / 16 * 16);
}

}  // namespace

template <class T>
const SkinnyKernels<T>& portable_skinny_kernels() {
  static const SkinnyKernels<T> kernels{&portable_outputs_by_inner<T>, &portable_inner_by_outputs<T>, 0, 0};
  return kernels;
}

template <class T>
const SkinnyKernels<T>& skinny_kernels() {
  static const SkinnyKernels<T>& chosen = avx512_skinny_kernels<T>()  ? *avx512_skinny_kernels<T>()
                                          : avx2_skinny_kernels<T>() ? *avx2_skinny_kernels<T>()
                                                                     : portable_skinny_kernels<T>();
  return chosen;
}

template <class T>
void skinny_products(const std::vector<SkinnyProduct<T>>& products, int64_t inner, int64_t outputs,
                     WeightLayout layout) {
  if (products.empty() || outputs <= 0) return;
  const SkinnyKernels<T>& kernels = skinny_kernels<T>();
  const SkinnyKernel<T> kernel =
      layout == WeightLayout::kOutputsByInner ? kernels.outputs_by_inner : kernels.inner_by_outputs;
  const int64_t tile = layout == WeightLayout::kOutputsByInner ? kOutputsPerTile
                                                                : stream_tile_outputs(products.size(), outputs);
  const int64_t tiles = (outputs + tile - 1) / tile;
  // The threads claim items as they finish the last, those of the products with the most rows
  // first (an item's time follows its product's rows).
  std::vector<double> rows;
  for (const SkinnyProduct<T>& p : products) rows.push_back(double(p.rows));
  WorkQueue queue(grouped_longest_first(rows, tiles));
  const int64_t workers = max_parallelism();
  parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (auto run = queue.claim_run(workers); run.first < run.second; run = queue.claim_run(workers)) {
      for (int64_t position = run.first; position < run.second; ++position) {
        const int64_t item = queue.at(position);
        const SkinnyProduct<T>& p = products[size_t(item / tiles)];
        const int64_t o_begin = (item % tiles) * tile;
        kernel(p, inner, o_begin, std::min(outputs, o_begin + tile));
      }
    }
  });
}

#define TUTEL_INSTANTIATE_SKINNY(T)                                                     \
  template const SkinnyKernels<T>& portable_skinny_kernels<T>();                       \
  template const SkinnyKernels<T>& skinny_kernels<T>();                                \
  template void skinny_products<T>(const std::vector<SkinnyProduct<T>>&, int64_t, int64_t, \
                                   WeightLayout);
TUTEL_INSTANTIATE_SKINNY(float)
TUTEL_INSTANTIATE_SKINNY(double)
TUTEL_INSTANTIATE_SKINNY(bfloat16)
TUTEL_INSTANTIATE_SKINNY(float16)
#undef TUTEL_INSTANTIATE_SKINNY

}  // namespace gemm
}  // namespace tutel
