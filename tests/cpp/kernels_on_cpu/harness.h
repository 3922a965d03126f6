// What the kernels-on-CPU tests share: launches with the operators' own plans
// (csrc/cuda/launch_plan.h), the error sink the kernels report to, output
// buffers that start as garbage, and the tolerance of a dot product.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/status.h"
#include "cuda/device_errors.h"
#include "cuda/launch_plan.h"
#include "cuda_emulation.h"

namespace kernels_on_cpu {

using tutel::emulation::GridSchedule;
using tutel::emulation::LaunchOptions;
using tutel::emulation::MemoryRegion;
using tutel::emulation::Schedule;

// Cycles through the schedules so that cases of one test run under different
// thread and block orders.
LaunchOptions schedule_for_case(int case_index);

// The schedules a case runs under: run-ahead (which exposes a missing barrier
// between phases of a kernel) and one of the others, in turn.
std::vector<LaunchOptions> schedules_for_case(int case_index);

// The schedules for kernels whose blocks hand data to one another through
// global memory (an atomic count or flag, and the data it guards): blocks
// interleaved, interleaved with one block starved after its first fence or
// atomic, one after another with one block moved behind the others; two of
// them per case, in turn, with varied thread orders and resident blocks.  The
// caller adds the launch's buffers as LaunchOptions::weak_memory, so that a
// store published without a fence shows as stale data (see cuda_emulation.h).
std::vector<LaunchOptions> cross_block_schedules_for_case(int case_index);

// The memory of a vector, as a weak-memory region.
template <class T>
MemoryRegion region_of(const std::vector<T>& v) {
  return MemoryRegion{v.data(), v.size() * sizeof(T)};
}

// Launches `body` (one kernel call) as csrc/cuda/launch.h launches on a GPU:
// nothing for an empty grid, refused for a grid CUDA cannot launch.
template <class Body>
void launch_planned(const char* kernel, tutel::cuda::Grid grid, const LaunchOptions& options, Body body) {
  if (tutel::cuda::grid_is_empty(grid)) return;
  if (!tutel::cuda::grid_fits(grid)) throw std::runtime_error(std::string(kernel) + ": grid too large for CUDA");
  tutel::emulation::launch(kernel, unsigned(grid.x), unsigned(grid.y), TUTEL_BLOCK_THREADS, body, options);
}

// kernel(args...) on every thread of `grid`, named in failures by the kernel's name.
#define TUTEL_EMULATED_LAUNCH(kernel, grid, options, ...) \
  ::kernels_on_cpu::launch_planned(#kernel, grid, options, [&] { kernel(__VA_ARGS__); })

// A buffer of n T whose bytes are all 0xff (NaN for floats, -1 for ints), as
// an uninitialised GPU allocation might be: outputs a kernel fails to write show.
template <class T>
std::vector<T> garbage(int64_t n) {
  std::vector<T> v(size_t(n > 0 ? n : 0));
  if (!v.empty()) std::memset(static_cast<void*>(v.data()), 0xff, v.size() * sizeof(T));
  return v;
}

// A tensor's memory: n elements at a 16-byte aligned address, or `shift`
// elements past one (so that the operators' plan picks the scalar kernels);
// nullptr when empty, as the operators pass empty tensors.  Exactly sized,
// so AddressSanitizer sees an access past the end.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(int64_t n, int shift = 0) : n_(n > 0 ? n : 0), shift_(shift) {
    if (n_ == 0) return;
    base_ = static_cast<T*>(::operator new(sizeof(T) * size_t(n_ + shift_), std::align_val_t(16)));
    std::memset(static_cast<void*>(base_), 0xff, sizeof(T) * size_t(n_ + shift_));  // garbage
  }
  DeviceBuffer(const std::vector<T>& values, int shift = 0) : DeviceBuffer(int64_t(values.size()), shift) {
    if (n_ > 0) std::memcpy(static_cast<void*>(data()), values.data(), sizeof(T) * size_t(n_));
  }
  ~DeviceBuffer() {
    if (base_ != nullptr) ::operator delete(base_, std::align_val_t(16));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() const { return base_ == nullptr ? nullptr : base_ + shift_; }
  MemoryRegion region() const { return MemoryRegion{data(), size_t(n_) * sizeof(T)}; }
  std::vector<T> values() const { return n_ == 0 ? std::vector<T>() : std::vector<T>(data(), data() + n_); }

 private:
  int64_t n_;
  int shift_;
  T* base_ = nullptr;
};

// The device error record and flag, on the host.
struct ErrorChannel {
  TutelErrorRecord record{0ull, ~0ull, 0, 0};
  unsigned flag = 0;
  TutelErrorSink sink() { return TutelErrorSink{&record, &flag, 7}; }
  std::optional<tutel::cuda::DataError> error() const { return tutel::cuda::decode_error_record(record); }
};

// The kernels' report equals the CPU operator's Status (same first bad entry).
void expect_same_error(const ErrorChannel& channel, const tutel::core::Status& status, int op);

// Element-wise bitwise equality, naming the first differing index.
template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "sizes " << got.size() << " and " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      auto failure = ::testing::AssertionFailure() << "first difference at element " << i << " of " << got.size();
      if constexpr (std::is_arithmetic<T>::value) failure << ": got " << +got[i] << ", want " << +want[i];
      return failure;
    }
  return ::testing::AssertionSuccess();
}

// Whether a dot product computed in accumulation type A, in any order, is
// within the rounding error of `terms` sums: |got - exact| <= n * eps(A) * sum |x_i y_i|.
// `exact` and `magnitude` come from the test's float64 (long double) loop.
template <class A>
::testing::AssertionResult dot_close(A got, long double exact, long double magnitude, int64_t terms) {
  const long double eps = sizeof(A) == 8 ? 0x1p-53L : 0x1p-24L;
  const long double bound = (terms + 1) * eps * magnitude * 1.01L + 1e-300L;
  const long double error = got > exact ? got - exact : exact - got;
  if (error <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "dot " << double(got) << " vs float64 " << double(exact)
                                       << ": error " << double(error) << " > bound " << double(bound);
}

}  // namespace kernels_on_cpu
