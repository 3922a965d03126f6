// Data errors found by the kernels (an expert index out of range, a negative
// location), reported without synchronising the host with the device.
//
// Each device has a TutelErrorRecord in device memory and a flag in mapped
// host memory (kernels/kernel_abi.h).  A kernel that meets a bad entry
// treats it as dropped, records the first one and raises the flag.  The host
// reads the flag, a plain memory read, before every tutel CUDA operator; only
// when it is raised does it synchronise, read the record and report it.  See
// docs/cuda-backend.md for where errors surface.
#pragma once

#include <cstdint>
#include <optional>

#include "../../kernels/kernel_abi.h"

namespace tutel {
namespace cuda {

struct DataError {
  int op = 0;    // TUTEL_OP_*
  int code = 0;  // TUTEL_ERROR_*
  int64_t choice = 0;
  int64_t token = 0;
  int64_t value = 0;
};

// Where the next launch on `device` reports (a fresh call id each time).
// The device's primary context must be current.
TutelErrorSink error_sink(int device);

// The error reported on `device` since the last call, if any, and clears it.
// If `synchronize`, waits for all work on the device first, so that every
// launch made so far has reported; otherwise returns nullopt at no cost
// unless some kernel has already raised the flag, and then synchronises.
// The device's primary context must be current; never call with an error
// pending while a stream is being captured (synchronising is not allowed).
std::optional<DataError> take_data_error(int device, bool synchronize);

// The error a record holds (see TutelErrorRecord), or nullopt for the empty record.
std::optional<DataError> decode_error_record(const TutelErrorRecord& record);

// True if a kernel on `device` has raised the flag (a plain memory read).
bool data_error_pending(int device);

}  // namespace cuda
}  // namespace tutel
