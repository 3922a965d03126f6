#include "compile_target.h"

#include <algorithm>

#include "nvrtc.h"

namespace tutel {
namespace cuda {

std::string CompileTarget::name() const {
  return (cubin ? "sm_" : "compute_") + std::to_string(arch);
}

CompileTarget choose_compile_target(int device_major, int device_minor,
                                    const std::vector<int>& supported,
                                    std::pair<int, int> nvrtc_version) {
  const int device_arch = 10 * device_major + device_minor;
  if (std::find(supported.begin(), supported.end(), device_arch) != supported.end())
    return CompileTarget{device_arch, true};
  int best = 0;
  for (int arch : supported)
    if (arch <= device_arch) best = std::max(best, arch);
  if (best > 0) return CompileTarget{best, false};
  const std::string version = std::to_string(nvrtc_version.first) + "." + std::to_string(nvrtc_version.second);
  throw NvrtcError("tutel: the GPU's compute capability " + std::to_string(device_major) + "." +
                   std::to_string(device_minor) + " is older than every architecture NVRTC " +
                   version + " can compile for (the oldest is sm_" +
                   (supported.empty() ? std::string("?") : std::to_string(supported.front())) +
                   "). Install an older NVRTC that still supports this GPU, e.g. "
                   "pip install 'nvidia-cuda-nvrtc-cu12==12.*', and point TUTEL_NVRTC_LIBRARY "
                   "at its libnvrtc.so if another one is found first.");
}

}  // namespace cuda
}  // namespace tutel
