// decode_quantized_experts on CPU: the operator's checks, then core::decode_quantized_experts
// with the kernels in force: the widest this CPU runs, unless
// tutel._C._set_quantized_decode_kernels chose narrower ones (as the tests do, to check every
// kernel set this CPU has).
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <string>
#include <vector>

#include "../../core/quantized_decode.h"
#include "../core_types.h"
#include "../decode_quantized_experts_args.h"

namespace tutel {
namespace ops {
namespace {

// The kernel sets by name, widest first; "best" is the first this CPU runs.
std::vector<const core::QuantKernels*> available_kernels() {
  std::vector<const core::QuantKernels*> sets;
  for (const core::QuantKernels* kernels :
       {core::avx512_bf16_quant_kernels(), core::avx512_quant_kernels(), core::avx2_quant_kernels()}) {
    if (kernels != nullptr) sets.push_back(kernels);
  }
  sets.push_back(&core::portable_quant_kernels());
  return sets;
}

// The kernels asked for (nullptr: the best).
std::atomic<const core::QuantKernels*> g_chosen{nullptr};

const core::QuantKernels& kernels_in_force() {
  const core::QuantKernels* chosen = g_chosen.load(std::memory_order_relaxed);
  return chosen != nullptr ? *chosen : core::best_quant_kernels();
}

core::QuantizedMatrix matrix_of(const DecodeQuantizedExpertsArgs& a, const QuantizedStackArgs& s) {
  core::QuantizedMatrix m;
  m.format = a.format;
  m.codes = reinterpret_cast<const uint8_t*>(s.codes.data_ptr());
  m.rows = s.rows;
  m.cols = s.cols;
  if (a.format == core::QuantFormat::kFp8Block) {
    m.float_scales = s.scales.data_ptr<float>();
    m.block_rows = a.block_rows;
    m.block_cols = a.block_cols;
  } else {
    m.byte_scales = s.scales.data_ptr<uint8_t>();
  }
  m.global_scales = s.global.defined() ? s.global.data_ptr<float>() : nullptr;
  return m;
}

template <class T>
void run(const DecodeQuantizedExpertsArgs& a, at::Tensor& out) {
  core::QuantizedDecodeCall<core_t<T>> call;
  call.x = core_ptr<T>(a.x);
  call.x_stride = a.x.size(0) > 1 ? a.x.stride(0) : a.hidden;
  call.expert_ids = a.expert_ids.data_ptr<int64_t>();
  call.weights = a.weights.defined() ? a.weights.data_ptr<float>() : nullptr;
  call.tokens = a.tokens;
  call.k = a.k;
  call.experts = a.experts;
  call.hidden = a.hidden;
  call.inter = a.inter;
  call.outputs = a.outputs;
  call.gate_up = matrix_of(a, a.gate_up);
  call.down = matrix_of(a, a.down);
  call.gate_up_bias = a.gate_up_bias.defined() ? a.gate_up_bias.data_ptr<float>() : nullptr;
  call.down_bias = a.down_bias.defined() ? a.down_bias.data_ptr<float>() : nullptr;
  call.unit = a.unit;
  call.out = core_ptr<T>(out);
  core::decode_quantized_experts(call, kernels_in_force());
}

at::Tensor decode_quantized_experts_cpu(
    const at::Tensor& x, const at::Tensor& expert_ids, const c10::optional<at::Tensor>& weights,
    c10::string_view format, const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
    const c10::optional<at::Tensor>& gate_up_global, const at::Tensor& down, const at::Tensor& down_scales,
    const c10::optional<at::Tensor>& down_global, at::IntArrayRef block, const c10::optional<at::Tensor>& gate_up_bias,
    const c10::optional<at::Tensor>& down_bias, c10::string_view activation, double alpha, double up_offset,
    c10::optional<double> limit, bool interleaved) {
  RECORD_FUNCTION("tutel::decode_quantized_experts", c10::ArrayRef<c10::IValue>({}));
  const DecodeQuantizedExpertsArgs a = decode_quantized_experts_args(
      x, expert_ids, weights, std::string(format), gate_up, gate_up_scales, gate_up_global, down, down_scales,
      down_global, block, gate_up_bias, down_bias, std::string(activation), alpha, up_offset, limit, interleaved);
  at::Tensor out = at::empty({a.tokens, a.outputs}, x.options());
  if (a.tokens == 0 || a.outputs == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(a, out); break;
    case at::kBFloat16: run<c10::BFloat16>(a, out); break;
    default: run<c10::Half>(a, out); break;  // the checks allow no other dtype
  }
  return out;
}

}  // namespace

void register_quantized_decode_functions(pybind11::module_& m) {
  m.def(
      "_quantized_decode_kernels", [] { return std::string(kernels_in_force().name); },
      "The kernels decode_quantized_experts runs on the CPU: 'avx512', 'avx2' or 'portable'.");
  m.def(
      "_quantized_decode_kernel_sets",
      [] {
        std::vector<std::string> names;
        for (const core::QuantKernels* kernels : available_kernels()) names.push_back(kernels->name);
        return names;
      },
      "The kernel sets this CPU runs, widest first.");
  m.def(
      "_set_quantized_decode_kernels",
      [](const std::string& name) {
        if (name == "best") {
          g_chosen.store(nullptr, std::memory_order_relaxed);
          return;
        }
        std::string allowed = "'best'";
        for (const core::QuantKernels* kernels : available_kernels()) {
          if (name == kernels->name) {
            g_chosen.store(kernels, std::memory_order_relaxed);
            return;
          }
          allowed += std::string(", '") + kernels->name + "'";
        }
        TORCH_CHECK_VALUE(false, "tutel.ops.decode_quantized_experts.set_quantized_decode_kernels: `name` '", name,
                          "' is not a kernel set this CPU runs; allowed: ", allowed);
      },
      "Makes decode_quantized_experts run the named kernels ('best': the widest this CPU runs) from now on.",
      pybind11::arg("name"));
}

TORCH_LIBRARY_IMPL(tutel, CPU, m) { m.impl("decode_quantized_experts", &decode_quantized_experts_cpu); }

}  // namespace ops
}  // namespace tutel
