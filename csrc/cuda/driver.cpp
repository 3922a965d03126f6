#include "driver.h"

#include <array>
#include <atomic>
#include <memory>
#include <mutex>

#include "dynamic_library.h"

namespace tutel {
namespace cuda {
namespace {

constexpr int kMaxDevices = 64;

const driver_api::Functions& load_driver() {
  std::string error;
  auto library = DynamicLibrary::open("libcuda.so.1", /*global=*/false, &error);
  if (!library)
    throw DriverError("tutel: cannot load the CUDA driver library libcuda.so.1 (" + error +
                      "). tutel's CUDA operators need the NVIDIA driver: install it (nvidia-smi "
                      "should then list the GPU), or keep the tensors on the CPU.");
  // Both stay for the life of the process.
  static std::unique_ptr<DynamicLibrary> kept_library;
  static driver_api::Functions functions;
#define TUTEL_RESOLVE(name, symbol, params) library->resolve(symbol, functions.name, "the CUDA driver");
  TUTEL_DRIVER_FUNCTIONS(TUTEL_RESOLVE)
#undef TUTEL_RESOLVE
  kept_library = std::move(library);
  const CUresult result = functions.cuInit(0);
  if (result != driver_api::kSuccess)
    throw DriverError("tutel: cuInit failed with CUDA error " + std::to_string(result) +
                      "; the NVIDIA driver cannot use the GPU (see nvidia-smi)");
  return functions;
}

void check_device_index(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw DriverError("tutel: CUDA device index " + std::to_string(device) +
                      " is outside the supported range [0, " + std::to_string(kMaxDevices) + ")");
}

}  // namespace

const driver_api::Functions& driver() {
  // A throwing initialiser leaves the static uninitialised, so a later call
  // tries again.
  static const driver_api::Functions& functions = load_driver();
  return functions;
}

std::string describe_driver_error(CUresult result) {
  const char* name = nullptr;
  const char* description = nullptr;
  const auto& api = driver();
  if (api.cuGetErrorName(result, &name) != driver_api::kSuccess) name = nullptr;
  if (api.cuGetErrorString(result, &description) != driver_api::kSuccess) description = nullptr;
  std::string text = name ? std::string(name) : "CUDA error " + std::to_string(result);
  if (description) text += std::string(" (") + description + ")";
  return text;
}

void check_driver(CUresult result, const char* what) {
  if (result == driver_api::kSuccess) return;
  throw DriverError(std::string("tutel: ") + what + " failed: " + describe_driver_error(result));
}

std::string driver_cuda_version() {
  int version = 0;
  check_driver(driver().cuDriverGetVersion(&version), "cuDriverGetVersion");
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

void make_primary_context_current(int device) {
  static std::array<std::atomic<CUcontext>, kMaxDevices> primaries{};
  check_device_index(device);
  const auto& api = driver();
  CUcontext primary = primaries[device].load(std::memory_order_acquire);
  if (primary == nullptr) {
    CUdevice handle = 0;
    check_driver(api.cuDeviceGet(&handle, device), "cuDeviceGet");
    check_driver(api.cuDevicePrimaryCtxRetain(&primary, handle), "cuDevicePrimaryCtxRetain");
    primaries[device].store(primary, std::memory_order_release);
  }
  CUcontext current = nullptr;
  check_driver(api.cuCtxGetCurrent(&current), "cuCtxGetCurrent");
  if (current != primary) check_driver(api.cuCtxSetCurrent(primary), "cuCtxSetCurrent");
}

const DeviceProperties& device_properties(int device) {
  static std::mutex mutex;
  static std::array<std::unique_ptr<DeviceProperties>, kMaxDevices> cache;
  check_device_index(device);
  std::lock_guard<std::mutex> guard(mutex);
  if (!cache[device]) {
    const auto& api = driver();
    CUdevice handle = 0;
    check_driver(api.cuDeviceGet(&handle, device), "cuDeviceGet");
    auto properties = std::make_unique<DeviceProperties>();
    check_driver(api.cuDeviceGetAttribute(&properties->major,
                                          driver_api::kAttributeComputeCapabilityMajor, handle),
                 "cuDeviceGetAttribute");
    check_driver(api.cuDeviceGetAttribute(&properties->minor,
                                          driver_api::kAttributeComputeCapabilityMinor, handle),
                 "cuDeviceGetAttribute");
    check_driver(api.cuDeviceGetAttribute(&properties->multiprocessors,
                                          driver_api::kAttributeMultiprocessorCount, handle),
                 "cuDeviceGetAttribute");
    cache[device] = std::move(properties);
  }
  return *cache[device];
}

bool is_capturing(CUstream stream) {
  int status = driver_api::kCaptureStatusNone;
  check_driver(driver().cuStreamIsCapturing(stream, &status), "cuStreamIsCapturing");
  return status != driver_api::kCaptureStatusNone;
}

RelaxedCaptureMode::RelaxedCaptureMode() : previous_(driver_api::kCaptureModeRelaxed) {
  check_driver(driver().cuThreadExchangeStreamCaptureMode(&previous_),
               "cuThreadExchangeStreamCaptureMode");
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  driver().cuThreadExchangeStreamCaptureMode(&previous_);
}

}  // namespace cuda
}  // namespace tutel
