#include "cuda_op.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <limits>
#include <string>

#include "../../cuda/device_errors.h"
#include "../../cuda/driver.h"
#include "../checks.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const char* op_name(int op) {
  switch (op) {
    case TUTEL_OP_GATHER_SLOTS: return "gather_slots";
    case TUTEL_OP_SCATTER_SLOTS: return "scatter_slots";
    default: return "assign_locations";
  }
}

// Problems of the kernel machinery that do not stop it (no writable disk
// cache, PTX for a GPU newer than NVRTC) become Python warnings.
void warn_through_torch(const std::string& message) { TORCH_WARN(message); }
[[maybe_unused]] const bool kWarningsInstalled = (cuda::set_warning_handler(&warn_through_torch), true);

}  // namespace

CudaOpScope::CudaOpScope(const at::Tensor& tensor)
    : guard_(tensor.device()), device_(tensor.get_device()) {
  cuda::make_primary_context_current(device_);
  stream_ = reinterpret_cast<cuda::CUstream>(c10::cuda::getCurrentCUDAStream(device_).stream());
  // Reporting needs a synchronisation, which a stream capture forbids; the
  // error then waits for the first call outside the capture.
  if (cuda::data_error_pending(device_) && !cuda::is_capturing(stream_)) raise_data_errors(device_);
}

TutelErrorSink CudaOpScope::error_sink() const { return cuda::error_sink(device_); }

int CudaOpScope::multiprocessors() const { return cuda::device_properties(device_).multiprocessors; }

void raise_data_errors(int device) {
  const auto error = cuda::take_data_error(device, /*synchronize=*/true);
  if (!error) return;
  const core::Status status{error->code == TUTEL_ERROR_EXPERT_INDEX
                                ? core::StatusCode::kExpertIndexOutOfRange
                                : core::StatusCode::kNegativeLocation,
                            error->choice, error->token, error->value};
  raise_if_failed(status, op_name(error->op),
                  "found on cuda:" + std::to_string(device) + " by an earlier call of tutel::" +
                      op_name(error->op) + ", which treated that choice as dropped; "
                      "tutel.cuda.check_errors() reports such errors right after a call");
}

Variant data_variant(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return Variant::kFloat32;
    case at::kDouble: return Variant::kFloat64;
    case at::kHalf: return Variant::kFloat16;
    case at::kBFloat16: return Variant::kBFloat16;
    default: C10_THROW_ERROR(TypeError, c10::str("tutel: no CUDA kernel for data of dtype ", dtype));
  }
}

Variant mask_variant(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBool: return Variant::kMaskBool;
    case at::kByte: return Variant::kMaskUint8;
    case at::kChar: return Variant::kMaskInt8;
    case at::kShort: return Variant::kMaskInt16;
    case at::kInt: return Variant::kMaskInt32;
    case at::kLong: return Variant::kMaskInt64;
    case at::kFloat: return Variant::kMaskFloat32;
    case at::kDouble: return Variant::kMaskFloat64;
    default: C10_THROW_ERROR(TypeError, c10::str("tutel: no CUDA cumsum kernel for dtype ", dtype));
  }
}

KernelFamily::~KernelFamily() {
  for (auto& handle : handles_) delete handle.load();
}

CUfunction KernelFamily::get(int device, Variant variant) const {
  auto& slot = handles_[static_cast<int>(variant)];
  cuda::KernelHandle* handle = slot.load(std::memory_order_acquire);
  if (handle == nullptr) {
    auto* created = new cuda::KernelHandle(file_, cuda::variant_define(variant), function_);
    if (slot.compare_exchange_strong(handle, created, std::memory_order_acq_rel)) {
      handle = created;
    } else {
      delete created;  // another thread made it first; `handle` now holds that one
    }
  }
  return handle->get(device);
}

void check_choice_count(int64_t k, int64_t tokens, const char* op) {
  TORCH_CHECK_VALUE(k * tokens <= std::numeric_limits<int32_t>::max(), "tutel::", op,
                    ": on CUDA at most 2^31-1 routed choices (k * tokens) are supported, got ", k,
                    " * ", tokens);
}

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
