// Python module entry point: importing tutel._C runs the static operator
// registrations of every ops/ file linked into it.
#include <torch/extension.h>

namespace tutel {
namespace ops {
void register_buffer_functions(pybind11::module_& m);  // ops/cpu/reusable_buffers.cpp
void register_cpu_gemm_functions(pybind11::module_& m);  // ops/cpu/cpu_gemm_switch.cpp
void register_routed_experts_function(pybind11::module_& m);  // ops/cpu/routed_experts_cpu.cpp
void register_routing_function(pybind11::module_& m);          // ops/cpu/routing_cpu.cpp
void register_quantized_decode_functions(pybind11::module_& m);  // ops/cpu/decode_quantized_experts_cpu.cpp
void register_quantized_linear_functions(pybind11::module_& m);  // ops/cpu/quantized_grouped_linear_cpu.cpp
}  // namespace ops
}  // namespace tutel

#ifdef TUTEL_WITH_CUDA
namespace tutel {
namespace ops {
namespace cuda_ops {
void register_python_functions(pybind11::module_& m);  // ops/cuda/python_functions.cpp
}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tutel compiled operators (registered under torch.ops.tutel)";
  tutel::ops::register_buffer_functions(m);
  tutel::ops::register_cpu_gemm_functions(m);
  tutel::ops::register_routed_experts_function(m);
  tutel::ops::register_routing_function(m);
  tutel::ops::register_quantized_decode_functions(m);
  tutel::ops::register_quantized_linear_functions(m);
#ifdef TUTEL_WITH_CUDA
  m.attr("with_cuda") = true;
  tutel::ops::cuda_ops::register_python_functions(m);
#else
  m.attr("with_cuda") = false;
#endif
}
