// Argument checks of a stack of quantized expert matrices [E, N, K] (core/quant_codes.h's formats),
// shared by the operators that read one (decode_quantized_experts, quantized_grouped_linear): the
// format by name, the codes', scales' and global scales' dtypes and shapes against the format's
// layout, naming the operator and the argument.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../core/quant_codes.h"

namespace tutel {
namespace ops {

// One checked stack, in the layouts the core kernels read (core/quantized_decode.h).
struct QuantizedStackArgs {
  at::Tensor codes;   // uint8 [E, N, K / 2] (fp4) or float8_e4m3fn [E, N, K] (fp8_block), contiguous
  at::Tensor scales;  // uint8 / float8_e4m3fn [E, N, K / block] (fp4), float32 blocks (fp8_block), contiguous
  at::Tensor global;  // nvfp4: float32 [E], else undefined
  int64_t rows = 0, cols = 0;
};

// The names of a stack's arguments, as errors give them.
struct QuantizedStackNames {
  const char* codes;
  const char* scales;
  const char* global;
};

// The format named `name` ('mxfp4', 'nvfp4', 'fp8_block'); a ValueError of operator `op` otherwise.
core::QuantFormat quant_format_of(const std::string& name, const char* op);

// The name of a format.
const char* quant_format_name(core::QuantFormat format);

// fp8_block's scale block [rows, cols] from `block` (both >= 1), into block_rows / block_cols; the
// fp4 formats take none (`block` must be empty, the outputs are left as they are).  A ValueError
// of operator `op` otherwise.
void read_quant_block(core::QuantFormat format, at::IntArrayRef block, const char* op, int64_t& block_rows,
                      int64_t& block_cols);

// One stack [E, N, K] of `format`, K taken from the codes, on `x`'s device; fp8_block's scale
// block is block_rows x block_cols.  Scales come back as the kernels read them: E8M0 / E4M3 as
// bytes, fp8_block's as float32.
QuantizedStackArgs checked_quantized_stack(core::QuantFormat format, const at::Tensor& codes, const at::Tensor& scales,
                                           const c10::optional<at::Tensor>& global, int64_t block_rows,
                                           int64_t block_cols, const at::Tensor& x, const char* op,
                                           const QuantizedStackNames& names);

}  // namespace ops
}  // namespace tutel
