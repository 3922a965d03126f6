// Python module entry point: importing tutel._C runs the static operator
// registrations of every ops/ file linked into it.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tutel compiled operators (registered under torch.ops.tutel)";
#ifdef TUTEL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
