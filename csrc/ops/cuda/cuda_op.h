// What the CUDA operators share: the per-call setup (device, stream, earlier
// data errors), the kernel tables, and small helpers for kernel arguments.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <atomic>
#include <cstdint>

#include "../../cuda/driver_api.h"
#include "../../cuda/kernel_params.h"
#include "../../cuda/kernel_programs.h"
#include "../../cuda/launch.h"
#include "../../cuda/launch_plan.h"

namespace tutel {
namespace ops {
namespace cuda_ops {

// Set up at the start of every CUDA operator: makes the tensor's device
// current (for the runtime and the driver), picks PyTorch's current stream,
// and raises a data error that an earlier launch on the device found (see
// cuda/device_errors.h; no synchronisation unless one is pending).
class CudaOpScope {
 public:
  CudaOpScope(const at::Tensor& tensor);

  int device() const { return device_; }
  cuda::CUstream stream() const { return stream_; }
  // Where a launch that reads caller-made indices reports bad ones.
  TutelErrorSink error_sink() const;
  // A sink that reports nothing, for indices tutel produced itself.
  static TutelErrorSink no_reports() { return TutelErrorSink{nullptr, nullptr, 0}; }
  int multiprocessors() const;

 private:
  c10::cuda::CUDAGuard guard_;
  int device_;
  cuda::CUstream stream_;
};

// Synchronises `device` and raises the first data error its kernels have
// found since the last report, as the CPU operators would have (IndexError
// for an expert index, ValueError for a location), saying that it was found
// by an earlier call.
void raise_data_errors(int device);

// The variants a kernel source is compiled in (see cuda/launch_plan.h).
using cuda::Variant;

// The variant for floating-point data of `dtype` (TUTEL_DTYPE_*).
Variant data_variant(at::ScalarType dtype);
// The variant for a cumsum mask of `dtype` (TUTEL_MASK_*).
Variant mask_variant(at::ScalarType dtype);

// One kernel of kernels/<file> in all of the file's variants; handles are
// made on first use.  Made only as a Kernel (below).
class KernelFamily {
 public:
  ~KernelFamily();

 protected:
  KernelFamily(const char* file, const char* function) : file_(file), function_(function) {}
  CUfunction get(int device, Variant variant) const;

 private:
  const char* file_;
  const char* function_;
  mutable std::array<std::atomic<cuda::KernelHandle*>, static_cast<int>(Variant::kCount)> handles_{};
};

// The kernel K of cuda/kernel_params.h (generated from kernels/), declared as a
// `const Kernel<cuda::kernels::NAME>` static: get() hands back its function with
// K's parameter list, so that cuda::launch_kernel checks a launch's argument
// types against the kernel's at compile time.
template <class K>
class Kernel : public KernelFamily {
 public:
  Kernel() : KernelFamily(K::file, K::function) {}
  cuda::CheckedFunction<typename K::params> get(int device, Variant variant = Variant::kNone) const {
    return {KernelFamily::get(device, variant)};
  }
};

// Pointer arguments: nullptr for an undefined or empty optional tensor.
inline const void* input_ptr(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr() : nullptr;
}
inline void* output_ptr(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr() : nullptr;
}

// The kernels number choices with 32-bit integers: k * tokens < 2^31.
void check_choice_count(int64_t k, int64_t tokens, const char* op);

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
