#include "quantized_stack_args.h"

#include "checks.h"

namespace tutel {
namespace ops {

core::QuantFormat quant_format_of(const std::string& name, const char* op) {
  if (name == "mxfp4") return core::QuantFormat::kMxfp4;
  if (name == "nvfp4") return core::QuantFormat::kNvfp4;
  TORCH_CHECK_VALUE(name == "fp8_block", "tutel::", op, ": `format` '", name,
                    "' is not a weight format; allowed: 'mxfp4', 'nvfp4', 'fp8_block'");
  return core::QuantFormat::kFp8Block;
}

const char* quant_format_name(core::QuantFormat format) {
  switch (format) {
    case core::QuantFormat::kMxfp4: return "mxfp4";
    case core::QuantFormat::kNvfp4: return "nvfp4";
    case core::QuantFormat::kFp8Block: return "fp8_block";
  }
  return "?";
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

QuantizedStackArgs checked_quantized_stack(core::QuantFormat format, const at::Tensor& codes, const at::Tensor& scales,
                                           const c10::optional<at::Tensor>& global, int64_t block_rows,
                                           int64_t block_cols, const at::Tensor& x, const char* op,
                                           const QuantizedStackNames& names) {
  const char* const name = names.codes;
  const char* const scales_name = names.scales;
  const char* const global_name = names.global;
  QuantizedStackArgs s;
  check_dim(codes, 3, op, name);
  check_same_device(x, codes, op, name);
  const bool fp4 = format != core::QuantFormat::kFp8Block;
  if (fp4) {
    TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "tutel::", op, ": `", name, "` must hold ",
                     quant_format_name(format), " codes as uint8 (two a byte), got ", codes.scalar_type());
  } else {
    TORCH_CHECK_TYPE(codes.scalar_type() == at::kFloat8_e4m3fn, "tutel::", op, ": `", name,
                     "` must be float8_e4m3fn for fp8_block, got ", codes.scalar_type());
  }
  s.codes = codes.contiguous();
  s.rows = codes.size(1);
  s.cols = fp4 ? 2 * codes.size(2) : codes.size(2);
  check_dim(scales, 3, op, scales_name);
  check_same_device(x, scales, op, scales_name);
  int64_t scale_rows = s.rows, scale_cols = 0;
  if (format == core::QuantFormat::kMxfp4) {
    TORCH_CHECK_VALUE(s.cols % core::kMxfp4Block == 0, "tutel::", op, ": `", name, "` ", codes.sizes(),
                      " holds rows of ", s.cols, " elements; mxfp4 needs a multiple of 32");
    TORCH_CHECK_TYPE(scales.scalar_type() == at::kByte, "tutel::", op, ": `", scales_name,
                     "` must hold E8M0 scales as uint8, got ", scales.scalar_type());
    scale_cols = s.cols / core::kMxfp4Block;
  } else if (format == core::QuantFormat::kNvfp4) {
    TORCH_CHECK_VALUE(s.cols % core::kNvfp4Block == 0, "tutel::", op, ": `", name, "` ", codes.sizes(),
                      " holds rows of ", s.cols, " elements; nvfp4 needs a multiple of 16");
    TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat8_e4m3fn, "tutel::", op, ": `", scales_name,
                     "` must be float8_e4m3fn for nvfp4, got ", scales.scalar_type());
    scale_cols = s.cols / core::kNvfp4Block;
  } else {
    const auto dtype = scales.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "tutel::", op, ": `",
                     scales_name, "` must be float32, bfloat16 or float16 for fp8_block, got ", dtype);
    scale_rows = ceil_div(s.rows, block_rows);
    scale_cols = ceil_div(s.cols, block_cols);
  }
  TORCH_CHECK_VALUE(scales.size(0) == codes.size(0) && scales.size(1) == scale_rows && scales.size(2) == scale_cols,
                    "tutel::", op, ": `", scales_name, "` must be [", codes.size(0), ", ", scale_rows, ", ",
                    scale_cols, "] for `", name, "` ", codes.sizes(), " in ", quant_format_name(format), ", got ",
                    scales.sizes());
  if (format == core::QuantFormat::kFp8Block) {
    s.scales = scales.to(at::kFloat).contiguous();
  } else {
    // E4M3 scales are read as their bytes.
    s.scales = scales.scalar_type() == at::kByte ? scales.contiguous() : scales.contiguous().view(at::kByte);
  }
  if (format == core::QuantFormat::kNvfp4) {
    TORCH_CHECK_VALUE(global.has_value(), "tutel::", op, ": nvfp4 needs `", global_name,
                      "`, each expert's float32 scale [E]");
    check_dtype(*global, at::kFloat, op, global_name);
    TORCH_CHECK_VALUE(global->dim() == 1 && global->size(0) == codes.size(0), "tutel::", op, ": `", global_name,
                      "` must be [", codes.size(0), "], got ", global->sizes());
    check_same_device(x, *global, op, global_name);
    s.global = global->contiguous();
  } else {
    TORCH_CHECK_VALUE(!global.has_value(), "tutel::", op, ": `", global_name, "` is nvfp4's; ",
                      quant_format_name(format), " takes none");
  }
  return s;
}

void read_quant_block(core::QuantFormat format, at::IntArrayRef block, const char* op, int64_t& block_rows,
                      int64_t& block_cols) {
  if (format == core::QuantFormat::kFp8Block) {
    TORCH_CHECK_VALUE(block.size() == 2 && block[0] >= 1 && block[1] >= 1, "tutel::", op,
                      ": fp8_block needs `block` = [rows, cols] of its scales' blocks, both >= 1, got ", block);
    block_rows = block[0];
    block_cols = block[1];
  } else {
    TORCH_CHECK_VALUE(block.empty(), "tutel::", op, ": `block` is fp8_block's; ", quant_format_name(format),
                      " has its own (got ", block, ")");
  }
}

}  // namespace ops
}  // namespace tutel
