// The float products of quantized_products.h: the work items, the driver that runs them over the
// threads, and the portable kernels.
#include "quantized_products.h"

#include <algorithm>

#include "../core/parallel.h"
#include "work_balance.h"

namespace tutel {
namespace gemm {
namespace {

constexpr int64_t kStrip = kQuantizedStripOutputs;

void portable_decode_strip(const core::QuantizedMatrix& w, int64_t expert, int64_t o, float* strip) {
  std::vector<float> row(size_t(w.cols));
  for (int64_t j = 0; j < kStrip; ++j) {
    if (o + j < w.rows) {
      core::decode_row_values(w, expert, o + j, 0, w.cols, row.data());
    } else {
      std::fill(row.begin(), row.end(), 0.0f);
    }
    for (int64_t k = 0; k < w.cols; ++k) strip[k * kStrip + j] = row[size_t(k)];
  }
}

// Rows in blocks of four, each block's sums over the whole strip in registers or the first-level
// cache, one strip row (32 outputs) at a time: loops a compiler vectorises.
void portable_multiply_strip(const float* x, int64_t x_stride, int64_t rows, int64_t inner, const float* strip,
                             const float* bias, float* y, int64_t y_stride, int64_t outputs) {
  constexpr int64_t kBlock = 4;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t count = std::min(kBlock, rows - r0);
    float sums[kBlock][kStrip] = {};
    for (int64_t k = 0; k < inner; ++k) {
      const float* w = strip + k * kStrip;
      for (int64_t r = 0; r < count; ++r) {
        const float v = x[(r0 + r) * x_stride + k];
        for (int64_t j = 0; j < kStrip; ++j) sums[r][j] += v * w[j];
      }
    }
    for (int64_t r = 0; r < count; ++r)
      for (int64_t j = 0; j < outputs; ++j) y[(r0 + r) * y_stride + j] = sums[r][j] + (bias ? bias[j] : 0.0f);
  }
}

}  // namespace

std::vector<QuantizedItem> quantized_items(const int64_t* offsets, int64_t experts, int64_t outputs, int64_t width) {
  std::vector<int64_t> active;
  std::vector<double> rows;
  for (int64_t e = 0; e < experts; ++e) {
    if (offsets[e + 1] > offsets[e]) {
      active.push_back(e);
      rows.push_back(double(offsets[e + 1] - offsets[e]));
    }
  }
  const int64_t strips = (outputs + width - 1) / width;
  std::vector<QuantizedItem> items;
  if (strips == 0) return items;
  for (int64_t i : grouped_longest_first(rows, strips)) {
    const int64_t o = i % strips * width;
    items.push_back({active[size_t(i / strips)], o, std::min(outputs, o + width)});
  }
  return items;
}

const QuantizedStripKernels& portable_strip_kernels() {
  static const QuantizedStripKernels kernels{&portable_decode_strip, &portable_multiply_strip, "portable"};
  return kernels;
}

const QuantizedStripKernels& best_strip_kernels() {
  const QuantizedStripKernels* wide = avx512_strip_kernels();
  return wide != nullptr ? *wide : portable_strip_kernels();
}

void quantized_float_products(const QuantizedGroupedProducts<float>& call, const QuantizedStripKernels& kernels) {
  const int64_t inner = call.w.cols, outputs = call.w.rows;
  const std::vector<QuantizedItem> items = quantized_items(call.offsets, call.experts, outputs, kStrip);
  if (items.empty()) return;
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  WorkQueue queue(std::move(order));
  core::parallel_for(0, core::max_parallelism(), 1, [&](int64_t, int64_t) {
    // The decoded strip, kept per thread between calls (inner x 32 floats).
    static thread_local std::vector<float> strip;
    if (strip.size() < size_t(inner * kStrip)) strip.resize(size_t(inner * kStrip));
    for (int64_t claimed = queue.claim(); claimed >= 0; claimed = queue.claim()) {
      const QuantizedItem& item = items[size_t(claimed)];
      const int64_t first = call.offsets[item.expert];
      kernels.decode_strip(call.w, item.expert, item.o_begin, strip.data());
      kernels.multiply_strip(call.x + first * call.x_stride, call.x_stride, call.offsets[item.expert + 1] - first,
                             inner, strip.data(), call.bias ? call.bias + item.expert * outputs + item.o_begin : nullptr,
                             call.y + first * call.y_stride + item.o_begin, call.y_stride, item.o_end - item.o_begin);
    }
  });
}

}  // namespace gemm
}  // namespace tutel
