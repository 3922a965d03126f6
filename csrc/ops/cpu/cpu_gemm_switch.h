// Which GEMM the CPU expert products run on (TUTEL_CPU_GEMM).
//
// "tutel" (the default): the CPU GEMM of csrc/gemm, whose policy (gemm/policy.h) gives the groups
// it serves to the skinny and tile products and the rest to PyTorch's GEMM as single-threaded
// pieces claimed by the threads.  "torch": PyTorch's GEMM for every group, one at::mm / at::addmm
// after another, each spread over the threads by PyTorch (what F.grouped_mm does on the CPU), so
// that tutel's GEMM can be judged against it and turned off.  Every CPU expert product goes
// through grouped_linear and its backward (routed_gated_experts and token_linear included), which
// read the switch on each call.
#pragma once

#include <torch/extension.h>

namespace tutel {
namespace ops {

enum class CpuGemm { kTutel, kTorch };

// The choice in force: TUTEL_CPU_GEMM's at the first call (a ValueError naming the variable and
// the allowed values when it holds anything else), then whatever set_cpu_gemm chose.
CpuGemm cpu_gemm();

// Binds tutel._C._cpu_gemm() and tutel._C._set_cpu_gemm(name) (tutel.ops.cpu_gemm).
void register_cpu_gemm_functions(pybind11::module_& m);

}  // namespace ops
}  // namespace tutel
