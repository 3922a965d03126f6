// quantized_grouped_linear on CPU: the operator's checks, then the quantized products of
// gemm/quantized_products.h: the tile products for bfloat16 rows where the CPU has AMX, strips
// decoded to bfloat16 and multiplied by PyTorch's bfloat16 GEMM where it has AVX512-BF16 but not
// AMX, the float products otherwise (16-bit rows widened to float32 first and the results rounded
// back), with the kernels in force: the widest this CPU runs, unless
// tutel._C._set_quantized_linear_kernels chose others (as the tests do, to check every kernel set
// this CPU has).  W8A8 (activation_group > 0):
// the grouped rows quantized and dequantized into a float32 buffer first (core/activation_quant.h,
// in parallel over the rows), then the float products, whatever the rows' dtype.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "../../core/activation_quant.h"
#include "../../gemm/quantized_products.h"
#include "../../gemm/work_balance.h"
#include "../core_types.h"
#include "../quantized_grouped_linear_args.h"
#include "gemms_on_threads.h"
#include "reusable_buffers.h"

namespace tutel {
namespace ops {
namespace {

constexpr const char* kTiles = "amx";
constexpr const char* kBf16Gemm = "avx512_bf16";

// The kernel sets this CPU runs, widest first: "amx" (the tile products for bfloat16 rows; other
// rows take the widest float kernels), "avx512_bf16" (bfloat16 rows: strips in bfloat16 through
// PyTorch's GEMM; other rows as under "avx512"), then the float kernels.
std::vector<std::string> available_sets() {
  std::vector<std::string> sets;
  if (gemm::quantized_tile_products_available()) sets.push_back(kTiles);
  if (gemm::avx512_bf16_rows_decoder() != nullptr) sets.push_back(kBf16Gemm);
  if (gemm::avx512_strip_kernels() != nullptr) sets.push_back(gemm::avx512_strip_kernels()->name);
  sets.push_back(gemm::portable_strip_kernels().name);
  return sets;
}

// The index in available_sets() of the set asked for (0: the widest).
std::atomic<int> g_chosen{0};

std::string set_in_force() { return available_sets()[size_t(g_chosen.load(std::memory_order_relaxed))]; }

const gemm::QuantizedStripKernels& strip_kernels_in_force() {
  const std::string name = set_in_force();
  if (name == gemm::portable_strip_kernels().name) return gemm::portable_strip_kernels();
  return gemm::best_strip_kernels();
}

core::QuantizedMatrix matrix_of(const QuantizedGroupedLinearArgs& a) {
  core::QuantizedMatrix m;
  m.format = a.format;
  m.codes = reinterpret_cast<const uint8_t*>(a.stack.codes.data_ptr());
  m.rows = a.stack.rows;
  m.cols = a.stack.cols;
  if (a.format == core::QuantFormat::kFp8Block) {
    m.float_scales = a.stack.scales.data_ptr<float>();
    m.block_rows = a.block_rows;
    m.block_cols = a.block_cols;
  } else {
    m.byte_scales = a.stack.scales.data_ptr<uint8_t>();
  }
  m.global_scales = a.stack.global.defined() ? a.stack.global.data_ptr<float>() : nullptr;
  return m;
}

template <class T>
gemm::QuantizedGroupedProducts<T> products_of(const QuantizedGroupedLinearArgs& a, const at::Tensor& x,
                                              at::Tensor& y) {
  gemm::QuantizedGroupedProducts<T> call;
  call.x = reinterpret_cast<const T*>(x.data_ptr());
  call.x_stride = x.size(0) > 1 ? x.stride(0) : x.size(1);
  call.offsets = a.offsets.data();
  call.experts = a.experts;
  call.w = matrix_of(a);
  call.bias = a.bias.defined() ? a.bias.data_ptr<float>() : nullptr;
  call.y = reinterpret_cast<T*>(y.data_ptr());
  call.y_stride = y.size(1);
  return call;
}

// W8A8: the first `grouped` rows quantized per row and group of a.activation_group columns and
// dequantized, float32 [grouped, K] contiguous.
at::Tensor quantized_activations(const QuantizedGroupedLinearArgs& a, int64_t grouped) {
  const int64_t cols = a.rows.size(1), stride = grouped > 1 ? a.rows.stride(0) : cols;
  at::Tensor x = empty_reusable({grouped, cols}, a.rows.options().dtype(at::kFloat));
  float* out = x.data_ptr<float>();
  switch (a.rows.scalar_type()) {
    case at::kFloat:
      core::dynamic_activations(a.rows.data_ptr<float>(), stride, grouped, cols, a.activation_group, out);
      break;
    case at::kBFloat16:
      core::dynamic_activations(reinterpret_cast<const core::bfloat16*>(a.rows.data_ptr()), stride, grouped, cols,
                                a.activation_group, out);
      break;
    default:
      core::dynamic_activations(reinterpret_cast<const core::float16*>(a.rows.data_ptr()), stride, grouped, cols,
                                a.activation_group, out);
  }
  return x;
}

// Outputs per work item of the bfloat16 GEMM products: enough that each GEMM is wide enough for
// PyTorch's kernels and the calls are few, while the decoded rows stay in the core's cache.
constexpr int64_t kGemmStripOutputs = 256;

// b as three bfloat16 parts whose float32 sum is b (each part the rounding of what the parts before
// it left; 24 bits in three of 8); an infinite or NaN b as itself and two zeros.
void bias_parts(float b, uint16_t (&parts)[3]) {
  float rest = b;
  for (int i = 0; i < 3; ++i) {
    const c10::BFloat16 part(std::isfinite(b) || i == 0 ? rest : 0.0f);
    parts[i] = part.x;
    rest -= float(part);
  }
}

// The products for bfloat16 rows under "avx512_bf16".  Each work item (an expert and a strip of up
// to kGemmStripOutputs outputs) has its rows of W decoded exactly and rounded once to bfloat16, as the
// tile products round them, into a [outputs, width] buffer of its thread, and the expert's rows times
// its transpose go through one single-threaded PyTorch GEMM (float32 sums, rounded once into `out`;
// the threads claim the items, longest first).  A bias enters those sums as three bfloat16 parts in
// columns inner .. inner + 2 of the strip, met by columns of ones appended to a copy of the rows, so
// that it is added in float32 as the other products add it; width is then inner + 3 rounded up to 8
// (zeros past them).
void bf16_gemm_products(const QuantizedGroupedLinearArgs& a, at::Tensor& out) {
  const core::QuantizedMatrix w = matrix_of(a);
  const int64_t inner = w.cols, outputs = w.rows, grouped = a.offsets.back();
  const float* bias = a.bias.defined() ? a.bias.data_ptr<float>() : nullptr;
  const int64_t width = bias ? (inner + 3 + 7) / 8 * 8 : inner;
  at::Tensor x = a.rows.narrow(0, 0, grouped);
  if (bias) {
    at::Tensor widened = at::empty({grouped, width}, a.rows.options());
    widened.narrow(1, 0, inner).copy_(x);
    widened.narrow(1, inner, 3).fill_(1);
    widened.narrow(1, inner + 3, width - inner - 3).zero_();
    x = widened;
  }
  const std::vector<gemm::QuantizedItem> items =
      gemm::quantized_items(a.offsets.data(), a.experts, outputs, kGemmStripOutputs);
  if (items.empty()) return;
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  gemm::WorkQueue queue(std::move(order));
  const gemm::QuantizedRowsToBf16 decode = gemm::avx512_bf16_rows_decoder();
  const auto claim_items = [&] {
    static thread_local std::vector<uint16_t> strip;
    if (strip.size() < size_t(kGemmStripOutputs * width)) strip.resize(size_t(kGemmStripOutputs * width));
    for (int64_t claimed = queue.claim(); claimed >= 0; claimed = queue.claim()) {
      const gemm::QuantizedItem& item = items[size_t(claimed)];
      const int64_t first = a.offsets[size_t(item.expert)], rows = a.offsets[size_t(item.expert) + 1] - first;
      const int64_t count = item.o_end - item.o_begin;
      decode(w, item.expert, item.o_begin, count, strip.data(), width);
      if (bias) {
        for (int64_t j = 0; j < count; ++j) {
          uint16_t parts[3];
          bias_parts(bias[item.expert * outputs + item.o_begin + j], parts);
          uint16_t* tail = strip.data() + j * width + inner;
          std::fill(tail, tail + (width - inner), uint16_t(0));
          std::copy(parts, parts + 3, tail);
        }
      }
      const at::Tensor right = at::from_blob(strip.data(), {count, width}, {width, 1},
                                             a.rows.options().dtype(at::kBFloat16)).t();
      at::Tensor products = out.narrow(0, first, rows).narrow(1, item.o_begin, count);
      at::mm_out(products, x.narrow(0, first, rows), right);
    }
  };
  claim_on_threads(int64_t(items.size()), claim_items);
}

at::Tensor quantized_grouped_linear_cpu(const at::Tensor& rows, const at::Tensor& ends, c10::string_view format,
                                        const at::Tensor& codes, const at::Tensor& scales,
                                        const c10::optional<at::Tensor>& global_scale, at::IntArrayRef block,
                                        const c10::optional<at::Tensor>& bias, int64_t activation_group) {
  RECORD_FUNCTION("tutel::quantized_grouped_linear", c10::ArrayRef<c10::IValue>({}));
  const QuantizedGroupedLinearArgs a = quantized_grouped_linear_args(
      rows, ends, std::string(format), codes, scales, global_scale, block, bias, activation_group);
  const int64_t n = rows.size(0), outputs = a.stack.rows, grouped = a.offsets.back();
  at::Tensor out = empty_reusable({n, outputs}, rows.options());
  if (n == 0 || outputs == 0) return out;
  if (grouped < n) out.narrow(0, grouped, n - grouped).zero_();  // the rows of no expert
  if (grouped == 0) return out;
  if (a.activation_group > 0) {
    const bool wide = rows.scalar_type() == at::kFloat;
    const at::Tensor x = quantized_activations(a, grouped);
    at::Tensor y = wide ? out : empty_reusable({grouped, outputs}, rows.options().dtype(at::kFloat));
    gemm::quantized_float_products(products_of<float>(a, x, y), strip_kernels_in_force());
    if (!wide) out.narrow(0, 0, grouped).copy_(y);
    return out;
  }
  if (rows.scalar_type() == at::kBFloat16 && set_in_force() == kTiles) {
    gemm::quantized_tile_products(products_of<core::bfloat16>(a, a.rows, out));
    return out;
  }
  if (rows.scalar_type() == at::kBFloat16 && set_in_force() == kBf16Gemm) {
    bf16_gemm_products(a, out);
    return out;
  }
  const bool wide = rows.scalar_type() == at::kFloat;
  const at::Tensor x = wide ? a.rows : to_dtype_reusable(a.rows.narrow(0, 0, grouped), at::kFloat);
  at::Tensor y = wide ? out : empty_reusable({grouped, outputs}, rows.options().dtype(at::kFloat));
  gemm::quantized_float_products(products_of<float>(a, x, y), strip_kernels_in_force());
  if (!wide) out.narrow(0, 0, grouped).copy_(y);
  return out;
}

}  // namespace

void register_quantized_linear_functions(pybind11::module_& m) {
  m.def(
      "_quantized_linear_kernels", [] { return set_in_force(); },
      "The kernels quantized_grouped_linear runs on the CPU: 'amx', 'avx512_bf16', 'avx512' or 'portable'.");
  m.def(
      "_quantized_linear_kernel_sets", [] { return available_sets(); },
      "The kernel sets this CPU runs, widest first.");
  m.def(
      "_set_quantized_linear_kernels",
      [](const std::string& name) {
        if (name == "best") {
          g_chosen.store(0, std::memory_order_relaxed);
          return;
        }
        const std::vector<std::string> sets = available_sets();
        std::string allowed = "'best'";
        for (size_t i = 0; i < sets.size(); ++i) {
          if (name == sets[i]) {
            g_chosen.store(int(i), std::memory_order_relaxed);
            return;
          }
          allowed += ", '" + sets[i] + "'";
        }
        TORCH_CHECK_VALUE(false, "tutel.ops.quantized_linear.set_quantized_linear_kernels: `name` '", name,
                          "' is not a kernel set this CPU runs; allowed: ", allowed);
      },
      "Makes quantized_grouped_linear run the named kernels ('best': the widest this CPU runs) from now on.",
      pybind11::arg("name"));
}

TORCH_LIBRARY_IMPL(tutel, CPU, m) { m.impl("quantized_grouped_linear", &quantized_grouped_linear_cpu); }

}  // namespace ops
}  // namespace tutel
