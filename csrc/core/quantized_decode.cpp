// decode_quantized_experts' two passes (quantized_decode.h) and its portable kernels.
#include "quantized_decode.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "work_queue.h"

namespace tutel {
namespace core {
namespace {

int64_t padded(int64_t n) { return (n + kQuantVectorPadding - 1) / kQuantVectorPadding * kQuantVectorPadding; }

// ---- portable kernels -------------------------------------------------------------------------

// Row `row` of expert `expert`, elements [k0, k0 + len) of one scale block, decoded into w.
void decode_block(const QuantizedMatrix& m, int64_t expert, int64_t row, int64_t block, int64_t k0, int64_t len,
                  float* w) {
  const ByteTables& tables = byte_tables();
  const uint8_t* codes = m.row_codes(expert, row);
  if (m.format == QuantFormat::kFp8Block) {
    const float scale = m.row_float_scales(expert, row)[block];
    for (int64_t i = 0; i < len; ++i) w[i] = tables.e4m3[codes[k0 + i]] * scale;
    return;
  }
  const uint8_t s = m.row_byte_scales(expert, row)[block];
  const float scale = m.format == QuantFormat::kMxfp4 ? tables.e8m0[s] : tables.e4m3[s];
  for (int64_t i = 0; i < len; ++i) {
    const int64_t k = k0 + i;
    const uint8_t byte = codes[k / 2];
    w[i] = tables.e2m1[(k & 1) ? (byte >> 4) : (byte & 15)] * scale;
  }
}

int64_t block_width(const QuantizedMatrix& m) {
  if (m.format == QuantFormat::kMxfp4) return kMxfp4Block;
  if (m.format == QuantFormat::kNvfp4) return kNvfp4Block;
  return m.block_cols;
}

void portable_dots(const QuantizedMatrix& m, int64_t expert, const int64_t* rows, int row_count,
                   const float* const* vectors, int count, float* out) {
  const int64_t width = block_width(m);
  std::vector<float> w(size_t(width), 0.0f);
  std::vector<float> sums(size_t(count), 0.0f);
  for (int r = 0; r < row_count; ++r) {
    std::fill(sums.begin(), sums.end(), 0.0f);
    for (int64_t block = 0, k0 = 0; k0 < m.cols; ++block, k0 += width) {
      const int64_t len = std::min(width, m.cols - k0);
      decode_block(m, expert, rows[r], block, k0, len, w.data());
      for (int v = 0; v < count; ++v) {
        const float* x = vectors[v] + k0;
        float sum = sums[size_t(v)];
        for (int64_t i = 0; i < len; ++i) sum += w[size_t(i)] * x[i];
        sums[size_t(v)] = sum;
      }
    }
    const float global = m.global_scale(expert);
    for (int v = 0; v < count; ++v) out[r * count + v] = m.format == QuantFormat::kNvfp4 ? sums[size_t(v)] * global
                                                                                        : sums[size_t(v)];
  }
}

}  // namespace

void decode_row_values(const QuantizedMatrix& m, int64_t expert, int64_t row, int64_t k0, int64_t len, float* w) {
  const int64_t width = block_width(m), end = k0 + len;
  for (int64_t k = k0; k < end;) {
    const int64_t block = k / width, stop = std::min(end, (block + 1) * width);
    decode_block(m, expert, row, block, k, stop - k, w + (k - k0));
    k = stop;
  }
  if (m.format == QuantFormat::kNvfp4) {
    const float global = m.global_scale(expert);
    for (int64_t i = 0; i < len; ++i) w[i] *= global;
  }
}

namespace {

// ---- the call's plan --------------------------------------------------------------------------

// The kept choices sorted by expert (stably: token-major within an expert), and each active
// expert's range of them.
struct ChoicePlan {
  std::vector<int64_t> token;  // per kept choice, in expert order
  std::vector<float> weight;
  std::vector<int64_t> active;  // the experts with choices, ascending
  std::vector<int64_t> starts;  // active.size() + 1 offsets into token / weight
};

ChoicePlan plan_choices(const int64_t* ids, const float* weights, int64_t tokens, int64_t k, int64_t experts) {
  std::vector<int64_t> kept;
  kept.reserve(size_t(tokens * k));
  for (int64_t c = 0; c < tokens * k; ++c) {
    if (ids[c] >= 0 && ids[c] < experts) kept.push_back(c);
  }
  std::stable_sort(kept.begin(), kept.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  ChoicePlan plan;
  plan.token.reserve(kept.size());
  plan.weight.reserve(kept.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    const int64_t c = kept[i];
    if (i == 0 || ids[kept[i - 1]] != ids[c]) {
      plan.active.push_back(ids[c]);
      plan.starts.push_back(int64_t(i));
    }
    plan.token.push_back(c / k);
    plan.weight.push_back(weights ? weights[c] : 1.0f);
  }
  plan.starts.push_back(int64_t(kept.size()));
  return plan;
}

// The vectors one pass multiplies the rows with, one per kept choice, and the kernels that take
// them: float32 rows as they are or in the split layout (kQuantSplitRound), or bfloat16 rows in the
// bfloat16 layout (kQuantBf16Padding).
struct PassVectors {
  std::vector<const float*> rows;
  QuantRowDots dots = nullptr;
  std::vector<const uint16_t*> bf16_rows;
  QuantRowDotsBf16 bf16_dots = nullptr;

  // The dot products of `row_count` (up to kQuantMaxRows) rows with the vectors of choices first ..
  // first + count - 1, out[r * count + v]; the float32 kernels take two rows at a time.
  void operator()(const QuantizedMatrix& m, int64_t expert, const int64_t* picked, int row_count, int64_t first,
                  int count, float* out) const {
    if (bf16_dots != nullptr) {
      bf16_dots(m, expert, picked, row_count, bf16_rows.data() + first, count, out);
      return;
    }
    for (int r = 0; r < row_count; r += 2) {
      dots(m, expert, picked + r, std::min(2, row_count - r), rows.data() + first, count, out + r * count);
    }
  }
};

bool takes_split(const QuantKernels& kernels, const QuantizedMatrix& m) {
  return kernels.split_dots != nullptr && (m.format == QuantFormat::kMxfp4 || m.format == QuantFormat::kNvfp4);
}

int64_t split_padded(int64_t n) { return (n + kQuantSplitRound - 1) / kQuantSplitRound * kQuantSplitRound; }

// The bfloat16 kernels, for vectors that are exactly bfloat16.
bool takes_bf16(const QuantKernels& kernels, const QuantizedMatrix& m) {
  return kernels.bf16_dots != nullptr && bf16_takes(m);
}

int64_t bf16_padded(int64_t n) { return (n + kQuantBf16Padding - 1) / kQuantBf16Padding * kQuantBf16Padding; }

// `count` rows of `n` values, `stride` apart, each exactly a bfloat16 (bfloat16 tokens, or float32
// values rounded to bfloat16), as rows of bfloat16 bits in m's bfloat16 layout (kQuantBf16Padding)
// bf16_padded(n) apart, zeros past n.
template <class V>
std::vector<uint16_t> bf16_layout_rows(const QuantizedMatrix& m, const V* x, int64_t count, int64_t n,
                                       int64_t stride) {
  const int64_t width = bf16_padded(n), round_size = bf16_round(m);
  int64_t slot[kQuantBf16Padding];
  for (int64_t j = 0; j < round_size; ++j) slot[j] = bf16_layout_slot(m, j);
  std::vector<uint16_t> out(size_t(count * width), 0);
  parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      uint16_t* row = out.data() + c * width;
      for (int64_t k = 0; k < n; ++k) {
        const int64_t round = k / round_size * round_size;
        row[round + slot[k - round]] = Scalar<bfloat16>::store(Scalar<V>::load(x[c * stride + k])).bits;
      }
    }
  });
  return out;
}

// x[0 .. n) into `split` (split_padded(n) floats) in the split layout, zeros past n.
void split_row(const float* x, int64_t n, float* split) {
  constexpr int64_t half = kQuantSplitRound / 2;
  for (int64_t k0 = 0; k0 < split_padded(n); k0 += kQuantSplitRound) {
    for (int64_t j = 0; j < half; ++j) {
      const int64_t even = k0 + 2 * j, odd = even + 1;
      split[k0 + j] = even < n ? x[even] : 0.0f;
      split[k0 + half + j] = odd < n ? x[odd] : 0.0f;
    }
  }
}

// `count` rows of `n` floats, `stride` apart, as split rows `split_padded(n)` apart.
std::vector<float> split_rows(const float* x, int64_t count, int64_t n, int64_t stride) {
  const int64_t width = split_padded(n);
  std::vector<float> split(size_t(count * width));
  parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) split_row(x + c * stride, n, split.data() + c * width);
  });
  return split;
}

// v rounded to T and back: the unit's values take the tokens' dtype, as the model's experts (and
// quantized_grouped_linear's products at prefill sizes) keep them between the products.
template <class T>
float in_storage_type(float v) {
  return Scalar<T>::load(Scalar<T>::store(v));
}

// Hidden units per item of the gate/up pass and output rows per item of the down pass: enough
// items for every thread at one token and a few experts, each still a few dozen rows long.
constexpr int64_t kUnitsPerItem = 16;
constexpr int64_t kOutputsPerItem = 16;

// Rows read ahead of the kernels' loads.  Each pass reads its rows in order, an item's rows after
// the previous item's on the same thread (claimed_runs hands out runs of neighbouring items), and the
// hardware prefetchers pick up such short streams late, so that without these prefetches a
// thread's loads kept waiting on memory (benchmarks/quantized_experts.py measures the step).
constexpr int64_t kPrefetchRows = 8;

// Runs fn over [0, items) in runs of neighbouring items that each thread claims as it finishes the
// last (WorkQueue::claim_run: long runs first, single items last).  With a fixed split of the
// items, the thread whose share read faster waited at the end of every pass for the other
// (benchmarks/quantized_experts.py, the one-token step).
void claimed_runs(int64_t items, const std::function<void(int64_t, int64_t)>& fn) {
  std::vector<int64_t> order(static_cast<size_t>(items));
  std::iota(order.begin(), order.end(), int64_t(0));
  WorkQueue queue(std::move(order));
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(max_parallelism(), items));
  parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (auto run = queue.claim_run(workers); run.first < run.second; run = queue.claim_run(workers)) {
      fn(run.first, run.second);
    }
  });
}

template <class T>
void gate_up_pass(const QuantizedDecodeCall<T>& call, const ChoicePlan& plan,
                  const PassVectors& token_rows, float* h, int64_t h_stride) {
  const int64_t inter = call.inter;
  const bool gated = call.unit.activation == ExpertActivation::kGated;
  const bool interleaved = gated && call.unit.gated.interleaved;
  const int64_t blocks = (inter + kUnitsPerItem - 1) / kUnitsPerItem;
  const int64_t items = int64_t(plan.active.size()) * blocks;
  // The gated unit's gates and ups are gathered per item ([count tokens][gates | ups], kUnitsPerItem
  // each), its values then taken in one vector pass into h, as the grouped path's unit takes them,
  // and rounded to the tokens' dtype there.
  GatedUnit gathered = call.unit.gated;
  gathered.interleaved = false;
  claimed_runs(items, [&](int64_t item_begin, int64_t item_end) {
    std::vector<float> dots, gates_ups;
    for (int64_t item = item_begin; item < item_end; ++item) {
      const int64_t a = item / blocks, unit_begin = (item % blocks) * kUnitsPerItem;
      const int64_t unit_end = std::min(inter, unit_begin + kUnitsPerItem);
      const int64_t expert = plan.active[size_t(a)], first = plan.starts[size_t(a)];
      const int count = int(plan.starts[size_t(a) + 1] - first);
      const float* bias = call.gate_up_bias ? call.gate_up_bias + expert * call.gate_up.rows : nullptr;
      dots.resize(size_t(kQuantMaxRows * count));
      if (gated) gates_ups.resize(size_t(count * 2 * kUnitsPerItem));
      // Gated: two units' gate and up rows at a time; up-only: four units' rows.
      const int64_t units_per_call = gated ? kQuantMaxRows / 2 : kQuantMaxRows;
      for (int64_t i0 = unit_begin; i0 < unit_end; i0 += units_per_call) {
        const int units = int(std::min(units_per_call, unit_end - i0));
        int64_t rows[kQuantMaxRows];
        for (int u = 0; u < units; ++u) {
          const int64_t i = i0 + u;
          if (gated) {
            rows[2 * u] = interleaved ? 2 * i : i;
            rows[2 * u + 1] = interleaved ? 2 * i + 1 : inter + i;
          } else {
            rows[u] = i;
          }
        }
        const int row_count = gated ? 2 * units : units;
        token_rows(call.gate_up, expert, rows, row_count, first, count, dots.data());
        for (int v = 0; v < count; ++v) {
          if (gated) {
            float* gate_up = gates_ups.data() + v * 2 * kUnitsPerItem;
            for (int u = 0; u < units; ++u) {
              const int64_t at = i0 + u - unit_begin, gate = 2 * u, up = 2 * u + 1;
              gate_up[at] = dots[size_t(gate * count + v)] + (bias ? bias[rows[gate]] : 0.0f);
              gate_up[kUnitsPerItem + at] = dots[size_t(up * count + v)] + (bias ? bias[rows[up]] : 0.0f);
            }
          } else {
            float* h_row = h + (first + v) * h_stride;
            for (int r = 0; r < row_count; ++r) {
              const float u = dots[size_t(r * count + v)] + (bias ? bias[rows[r]] : 0.0f);
              h_row[rows[r]] = in_storage_type<T>(up_only_unit_value(call.unit.activation, u));
            }
          }
        }
      }
      if (gated) {
        GatedRows<float> units{};
        units.gate = gates_ups.data();
        units.up = gates_ups.data() + kUnitsPerItem;
        units.gate_stride = units.up_stride = 2 * kUnitsPerItem;
        units.out = h + first * h_stride + unit_begin;
        units.out_stride = h_stride;
        units.rows = count;
        units.width = unit_end - unit_begin;
        gated_forward_here(gathered, units);
        for (int v = 0; v < count; ++v) {
          float* h_row = h + (first + v) * h_stride;
          for (int64_t i = unit_begin; i < unit_end; ++i) h_row[i] = in_storage_type<T>(h_row[i]);
        }
      }
    }
  });
}

template <class T>
void down_pass(const QuantizedDecodeCall<T>& call, const ChoicePlan& plan,
               const PassVectors& h_rows, float* sums) {
  const int64_t outputs = call.outputs, tokens = call.tokens;
  const int64_t items = (outputs + kOutputsPerItem - 1) / kOutputsPerItem;
  claimed_runs(items, [&](int64_t item_begin, int64_t item_end) {
    std::vector<float> dots;
    for (int64_t item = item_begin; item < item_end; ++item) {
      const int64_t n_begin = item * kOutputsPerItem, n_end = std::min(outputs, n_begin + kOutputsPerItem);
      for (int64_t t = 0; t < tokens; ++t) std::fill(sums + t * outputs + n_begin, sums + t * outputs + n_end, 0.0f);
      for (size_t a = 0; a < plan.active.size(); ++a) {
        const int64_t expert = plan.active[a], first = plan.starts[a];
        const int count = int(plan.starts[a + 1] - first);
        const float* bias = call.down_bias ? call.down_bias + expert * outputs : nullptr;
        dots.resize(size_t(kQuantMaxRows * count));
        for (int64_t n = n_begin; n < n_end; n += kQuantMaxRows) {
          const int row_count = int(std::min<int64_t>(kQuantMaxRows, n_end - n));
          int64_t rows[kQuantMaxRows];
          for (int r = 0; r < row_count; ++r) rows[r] = n + r;
          h_rows(call.down, expert, rows, row_count, first, count, dots.data());
          for (int r = 0; r < row_count; ++r) {
            const float b = bias ? bias[rows[r]] : 0.0f;
            for (int v = 0; v < count; ++v) {
              const int64_t c = first + v;
              const float y = dots[size_t(r * count + v)] + b;
              sums[plan.token[size_t(c)] * outputs + rows[r]] += plan.weight[size_t(c)] * y;
            }
          }
        }
      }
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t n = n_begin; n < n_end; ++n) call.out[t * outputs + n] = Scalar<T>::store(sums[t * outputs + n]);
      }
    }
  });
}

}  // namespace

float up_only_unit_value(ExpertActivation activation, float u) {
  switch (activation) {
    case ExpertActivation::kGated:
      break;  // (gated units take gated_forward_here)
    case ExpertActivation::kGelu:
      return 0.5f * u * (1.0f + std::erf(u * 0.70710678118654752f));
    case ExpertActivation::kGeluTanh:
      return 0.5f * u * (1.0f + std::tanh(0.79788456080286536f * (u + 0.044715f * u * u * u)));
    case ExpertActivation::kRelu:
      return u > 0.0f || std::isnan(u) ? u : 0.0f;
  }
  return u;
}

const QuantKernels& portable_quant_kernels() {
  static const QuantKernels kernels{&portable_dots, "portable", nullptr};
  return kernels;
}

const QuantKernels& best_quant_kernels() {
  static const QuantKernels& best = avx512_bf16_quant_kernels() ? *avx512_bf16_quant_kernels()
                                    : avx512_quant_kernels()    ? *avx512_quant_kernels()
                                    : avx2_quant_kernels()      ? *avx2_quant_kernels()
                                                                : portable_quant_kernels();
  return best;
}

template <class T>
void decode_quantized_experts(const QuantizedDecodeCall<T>& call, const QuantKernels& kernels) {
  const int64_t tokens = call.tokens, hidden = call.hidden, outputs = call.outputs;
  if (tokens == 0 || outputs == 0) return;
  const ChoicePlan plan = plan_choices(call.expert_ids, call.weights, tokens, call.k, call.experts);
  // Token rows in float32, each padded with zeros to the kernels' widest vectors.
  const int64_t x_stride = padded(hidden), h_stride = padded(call.inter);
  std::vector<float> x(size_t(tokens * x_stride), 0.0f);
  parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < hidden; ++i) x[size_t(t * x_stride + i)] = Scalar<T>::load(call.x[t * call.x_stride + i]);
    }
  });
  const size_t kept = plan.token.size();
  PassVectors token_rows, h_rows;
  token_rows.rows.resize(kept);
  h_rows.rows.resize(kept);
  std::vector<float> h(kept * size_t(h_stride), 0.0f);
  std::vector<float> x_split, h_split;
  std::vector<uint16_t> x_bf16, h_bf16;
  const bool bf16_tokens = std::is_same<T, bfloat16>::value;
  if (bf16_tokens && takes_bf16(kernels, call.gate_up)) {
    x_bf16 = bf16_layout_rows(call.gate_up, call.x, tokens, hidden, call.x_stride);
    token_rows.bf16_rows.resize(kept);
    for (size_t c = 0; c < kept; ++c) token_rows.bf16_rows[c] = x_bf16.data() + plan.token[c] * bf16_padded(hidden);
    token_rows.bf16_dots = kernels.bf16_dots;
  } else if (takes_split(kernels, call.gate_up)) {
    x_split = split_rows(x.data(), tokens, hidden, x_stride);
    for (size_t c = 0; c < kept; ++c) token_rows.rows[c] = x_split.data() + plan.token[c] * split_padded(hidden);
    token_rows.dots = kernels.split_dots;
  } else {
    for (size_t c = 0; c < kept; ++c) token_rows.rows[c] = x.data() + plan.token[c] * x_stride;
    token_rows.dots = kernels.dots;
  }
  QuantizedDecodeCall<T> prefetched = call;
  prefetched.gate_up = prefetching(call.gate_up, kPrefetchRows);
  prefetched.down = prefetching(call.down, kPrefetchRows);
  gate_up_pass(prefetched, plan, token_rows, h.data(), h_stride);
  if (bf16_tokens && takes_bf16(kernels, call.down)) {  // h is bfloat16 too
    h_bf16 = bf16_layout_rows(call.down, h.data(), int64_t(kept), call.inter, h_stride);
    h_rows.bf16_rows.resize(kept);
    for (size_t c = 0; c < kept; ++c) h_rows.bf16_rows[c] = h_bf16.data() + int64_t(c) * bf16_padded(call.inter);
    h_rows.bf16_dots = kernels.bf16_dots;
  } else if (takes_split(kernels, call.down)) {
    h_split = split_rows(h.data(), int64_t(kept), call.inter, h_stride);
    for (size_t c = 0; c < kept; ++c) h_rows.rows[c] = h_split.data() + int64_t(c) * split_padded(call.inter);
    h_rows.dots = kernels.split_dots;
  } else {
    for (size_t c = 0; c < kept; ++c) h_rows.rows[c] = h.data() + int64_t(c) * h_stride;
    h_rows.dots = kernels.dots;
  }
  std::vector<float> sums(size_t(tokens * outputs));
  down_pass(prefetched, plan, h_rows, sums.data());
}

template void decode_quantized_experts<float>(const QuantizedDecodeCall<float>&, const QuantKernels&);
template void decode_quantized_experts<bfloat16>(const QuantizedDecodeCall<bfloat16>&, const QuantKernels&);
template void decode_quantized_experts<float16>(const QuantizedDecodeCall<float16>&, const QuantKernels&);

}  // namespace core
}  // namespace tutel
