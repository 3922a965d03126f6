#include "device_errors.h"

#include <array>
#include <atomic>
#include <mutex>

#include "driver.h"
#include "kernel_programs.h"

namespace tutel {
namespace cuda {
namespace {

struct Channel {
  CUdeviceptr record = 0;           // TutelErrorRecord in device memory
  volatile unsigned* flag = nullptr;  // host view of the mapped flag
  CUdeviceptr flag_device = 0;      // device view of it
};

const TutelErrorRecord kEmptyRecord = {0ull, ~0ull, 0, 0};

std::mutex g_mutex;
std::array<std::atomic<Channel*>, kMaxKernelDevices> g_channels{};
std::atomic<unsigned long long> g_next_call_id{1};

Channel* existing_channel(int device) {
  if (device < 0 || device >= kMaxKernelDevices) return nullptr;
  return g_channels[device].load(std::memory_order_acquire);
}

Channel& channel(int device) {
  if (Channel* found = existing_channel(device)) return *found;
  if (device < 0 || device >= kMaxKernelDevices)
    throw DriverError("tutel: CUDA device index " + std::to_string(device) + " is out of range");
  std::lock_guard<std::mutex> guard(g_mutex);
  if (Channel* found = existing_channel(device)) return *found;
  const auto& api = driver();
  RelaxedCaptureMode relaxed;  // first use may happen while a stream is captured
  auto* created = new Channel();  // kept for the process: kernels may write until exit
  check_driver(api.cuMemAlloc(&created->record, sizeof(TutelErrorRecord)), "cuMemAlloc");
  check_driver(api.cuMemcpyHtoD(created->record, &kEmptyRecord, sizeof(kEmptyRecord)), "cuMemcpyHtoD");
  void* host = nullptr;
  check_driver(api.cuMemHostAlloc(&host, sizeof(unsigned),
                                  driver_api::kHostAllocPortable | driver_api::kHostAllocDeviceMap),
               "cuMemHostAlloc");
  created->flag = static_cast<volatile unsigned*>(host);
  *created->flag = 0;
  check_driver(api.cuMemHostGetDevicePointer(&created->flag_device, host, 0),
               "cuMemHostGetDevicePointer");
  g_channels[device].store(created, std::memory_order_release);
  return *created;
}

}  // namespace

TutelErrorSink error_sink(int device) {
  Channel& c = channel(device);
  TutelErrorSink sink;
  sink.record = reinterpret_cast<TutelErrorRecord*>(c.record);
  sink.flag = reinterpret_cast<unsigned int*>(c.flag_device);
  sink.call_id = g_next_call_id.fetch_add(1, std::memory_order_relaxed);
  return sink;
}

bool data_error_pending(int device) {
  Channel* c = existing_channel(device);
  return c != nullptr && *c->flag != 0;
}

std::optional<DataError> take_data_error(int device, bool synchronize) {
  Channel* c = existing_channel(device);
  if (c == nullptr) return std::nullopt;
  if (!synchronize && *c->flag == 0) return std::nullopt;
  const auto& api = driver();
  check_driver(api.cuCtxSynchronize(), "cuCtxSynchronize");
  std::lock_guard<std::mutex> guard(g_mutex);
  if (*c->flag == 0) return std::nullopt;
  TutelErrorRecord record;
  check_driver(api.cuMemcpyDtoH(&record, c->record, sizeof(record)), "cuMemcpyDtoH");
  check_driver(api.cuMemcpyHtoD(c->record, &kEmptyRecord, sizeof(kEmptyRecord)), "cuMemcpyHtoD");
  *c->flag = 0;
  return decode_error_record(record);
}

std::optional<DataError> decode_error_record(const TutelErrorRecord& record) {
  if (record.call_id == 0 || record.tokens <= 0) return std::nullopt;
  const int64_t entry = int64_t(record.key >> 33);
  DataError error;
  error.op = int(record.op);
  error.code = int((record.key >> 32) & 1u);
  error.choice = entry / record.tokens;
  error.token = entry % record.tokens;
  error.value = int64_t(int32_t(uint32_t(record.key & 0xffffffffu)));
  return error;
}

}  // namespace cuda
}  // namespace tutel
