// The CUDA driver (libcuda.so.1), opened with dlopen on first use, and the
// few things tutel does with it directly: the device's primary context,
// device attributes, capture state, and error-checked calls.
#pragma once

#include <stdexcept>
#include <string>

#include "driver_api.h"

namespace tutel {
namespace cuda {

// A driver call failed, or the driver is missing.
class DriverError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The driver's functions, loaded and initialised (cuInit) on first use.
// Throws DriverError explaining what is missing if libcuda cannot be opened.
const driver_api::Functions& driver();

// "CUDA_ERROR_... (description)" for a driver result code.
std::string describe_driver_error(CUresult result);

// Throws DriverError "tutel: <what> failed: CUDA_ERROR_... (description)"
// unless result is CUDA_SUCCESS.
void check_driver(CUresult result, const char* what);

// The CUDA version the driver supports, e.g. "12.4".
std::string driver_cuda_version();

// Makes the primary context of `device` (the one PyTorch uses) current on
// this thread if it is not already; modules are loaded into it.
void make_primary_context_current(int device);

struct DeviceProperties {
  int major = 0;
  int minor = 0;
  int multiprocessors = 0;
};

// Compute capability and size of `device` (cached).
const DeviceProperties& device_properties(int device);

// True while `stream` is being captured into a CUDA graph.
bool is_capturing(CUstream stream);

// While alive, this thread may make calls that stream capture otherwise
// forbids (loading modules, allocating), so that compiling a kernel on first
// use inside a capture does not invalidate the capture.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  int previous_;
};

}  // namespace cuda
}  // namespace tutel
