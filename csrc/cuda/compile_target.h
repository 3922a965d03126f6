// What NVRTC builds for a device: a CUBIN for the device's own architecture
// when this NVRTC knows it; otherwise PTX for the newest architecture it
// knows that the device can run, which the driver compiles for the device
// when it loads it (a GPU newer than the NVRTC).  A GPU older than every
// architecture NVRTC supports gets an error saying which NVRTC to install
// (the reference failed with "invalid value for --gpu-architecture").
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tutel {
namespace cuda {

struct CompileTarget {
  int arch = 0;       // 10 * major + minor
  bool cubin = true;  // false: PTX

  // "sm_90" for a CUBIN, "compute_90" for PTX.
  std::string name() const;
  // The NVRTC option selecting it.
  std::string option() const { return "--gpu-architecture=" + name(); }
};

// `supported` as returned by Nvrtc::supported_architectures (ascending).
// Throws NvrtcError when the device is older than all of them.
CompileTarget choose_compile_target(int device_major, int device_minor,
                                    const std::vector<int>& supported,
                                    std::pair<int, int> nvrtc_version);

}  // namespace cuda
}  // namespace tutel
