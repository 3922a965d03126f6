// A device guard for CUDA that does nothing, for a PyTorch built without CUDA.
//
// Autograd asks the guard of a tensor's device for its current stream when it records a node, so
// on a CPU-only PyTorch a graph of fake CUDA tensors cannot be recorded at all (the process
// aborts).  Loaded by tests/python/launch_count.py into such a PyTorch only, this guard lets the
// tests record and walk those graphs; nothing ever runs on a device.
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
}  // namespace
