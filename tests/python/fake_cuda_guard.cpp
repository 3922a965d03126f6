// A device guard for CUDA that does nothing, for a PyTorch without a usable CUDA device.
//
// Autograd asks the guard of a tensor's device for its current stream when it records a node, so
// on a CPU-only PyTorch a graph of fake CUDA tensors cannot be recorded at all (the process
// aborts), nor on some CUDA builds without a driver (2.4-2.6: their guard initialises CUDA and
// aborts).  Loaded by tests/python/launch_count.py only where no CUDA device is usable, this guard
// (registered last, it replaces a CUDA build's own) lets the tests record and walk those graphs;
// nothing ever runs on a device.
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
}  // namespace
