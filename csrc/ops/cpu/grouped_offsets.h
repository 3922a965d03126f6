// The group ends of rows grouped by expert (`offsets` [E] int32: expert e owns rows
// offsets[e - 1] .. offsets[e] - 1), checked where the CPU operators read them.  The CUDA kernels
// cannot read them without a host synchronisation and take them as they come (see their files).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace tutel {
namespace ops {

// ValueError naming `op` unless ends[0..experts) are non-decreasing and within [0, rows].
inline void check_offsets_values(const int* ends, int64_t experts, int64_t rows, const char* op) {
  int64_t previous = 0;
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK_VALUE(ends[e] >= previous && ends[e] <= rows, "tutel::", op, ": `offsets` must be non-decreasing ",
                      "ends of the experts' rows within [0, N = ", rows, "], got offsets[", e, "] = ", ends[e],
                      e > 0 ? " after " + std::to_string(previous) : std::string());
    previous = ends[e];
  }
}

}  // namespace ops
}  // namespace tutel
