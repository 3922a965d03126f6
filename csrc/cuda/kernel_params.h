// Generated from kernels/*.cu by csrc/cuda/kernel_params.py; do not edit (a test keeps it current).
// Each kernel: its file, its name and its parameters as the host passes them to cuLaunchKernel
// (cuda::launch_kernel checks a launch's arguments against them at compile time).
#pragma once

#include <cstdint>

#include "../../kernels/expert_abi.h"
#include "../../kernels/kernel_abi.h"
#include "kernel_param_kinds.h"

namespace tutel {
namespace cuda {
namespace kernels {

// kernels/cumsum.cu
struct cumsum_chunk_offsets {
  static constexpr const char* file = "cumsum.cu";
  static constexpr const char* function = "cumsum_chunk_offsets";
  using params = KernelParams<AnyPointer, int64_t, int64_t>;
};
struct cumsum_chunk_scan {
  static constexpr const char* file = "cumsum.cu";
  static constexpr const char* function = "cumsum_chunk_scan";
  using params = KernelParams<AnyPointer, int64_t, int64_t, int64_t, AnyPointer, AnyPointer>;
};
struct cumsum_chunk_totals {
  static constexpr const char* file = "cumsum.cu";
  static constexpr const char* function = "cumsum_chunk_totals";
  using params = KernelParams<AnyPointer, int64_t, int64_t, int64_t, AnyPointer>;
};

// kernels/decode_experts.cu
struct decode_down_columns_scalar {
  static constexpr const char* file = "decode_experts.cu";
  static constexpr const char* function = "decode_down_columns_scalar";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, AnyPointer, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct decode_down_columns_vector {
  static constexpr const char* file = "decode_experts.cu";
  static constexpr const char* function = "decode_down_columns_vector";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, AnyPointer, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct decode_down_rows_scalar {
  static constexpr const char* file = "decode_experts.cu";
  static constexpr const char* function = "decode_down_rows_scalar";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, AnyPointer, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct decode_down_rows_vector {
  static constexpr const char* file = "decode_experts.cu";
  static constexpr const char* function = "decode_down_rows_vector";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, AnyPointer, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct decode_gate_up_columns_scalar {
  static constexpr const char* file = "decode_experts.cu";
  static constexpr const char* function = "decode_gate_up_columns_scalar";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, AnyPointer, AnyPointer, AnyPointer, int64_t, int64_t, TutelDecodeUnit, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};
struct decode_gate_up_columns_vector {
  static constexpr const char* file = "decode_experts.cu";
  static constexpr const char* function = "decode_gate_up_columns_vector";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, AnyPointer, AnyPointer, AnyPointer, int64_t, int64_t, TutelDecodeUnit, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};
struct decode_gate_up_rows_scalar {
  static constexpr const char* file = "decode_experts.cu";
  static constexpr const char* function = "decode_gate_up_rows_scalar";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, AnyPointer, AnyPointer, AnyPointer, int64_t, int64_t, TutelDecodeUnit, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};
struct decode_gate_up_rows_vector {
  static constexpr const char* file = "decode_experts.cu";
  static constexpr const char* function = "decode_gate_up_rows_vector";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, AnyPointer, AnyPointer, AnyPointer, int64_t, int64_t, TutelDecodeUnit, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};

// kernels/dispatch.cu
struct gather_slots_scalar {
  static constexpr const char* file = "dispatch.cu";
  static constexpr const char* function = "gather_slots_scalar";
  using params = KernelParams<AnyPointer, AnyPointer, AnyPointer, TutelChoiceWeights, AnyPointer, AnyPointer, AnyPointer, int64_t, int64_t, int64_t, int64_t, int64_t, int, TutelErrorSink>;
};
struct gather_slots_vector {
  static constexpr const char* file = "dispatch.cu";
  static constexpr const char* function = "gather_slots_vector";
  using params = KernelParams<AnyPointer, AnyPointer, AnyPointer, TutelChoiceWeights, AnyPointer, AnyPointer, AnyPointer, int64_t, int64_t, int64_t, int64_t, int64_t, int, TutelErrorSink>;
};
struct scatter_claim_slots {
  static constexpr const char* file = "dispatch.cu";
  static constexpr const char* function = "scatter_claim_slots";
  using params = KernelParams<AnyPointer, AnyPointer, int64_t, int64_t, int64_t, int64_t, AnyPointer, AnyPointer, TutelErrorSink>;
};
struct scatter_slots_scalar {
  static constexpr const char* file = "dispatch.cu";
  static constexpr const char* function = "scatter_slots_scalar";
  using params = KernelParams<AnyPointer, AnyPointer, AnyPointer, TutelChoiceWeights, AnyPointer, AnyPointer, AnyPointer, int64_t, int64_t, int64_t, int64_t, int64_t, int, AnyPointer, int64_t>;
};
struct scatter_slots_vector {
  static constexpr const char* file = "dispatch.cu";
  static constexpr const char* function = "scatter_slots_vector";
  using params = KernelParams<AnyPointer, AnyPointer, AnyPointer, TutelChoiceWeights, AnyPointer, AnyPointer, AnyPointer, int64_t, int64_t, int64_t, int64_t, int64_t, int, AnyPointer, int64_t>;
};

// kernels/expert_rows.cu
struct add_expert_bias {
  static constexpr const char* file = "expert_rows.cu";
  static constexpr const char* function = "add_expert_bias";
  using params = KernelParams<AnyPointer, int64_t, AnyPointer, int64_t, AnyPointer, int64_t, int64_t, int64_t, int>;
};
struct choice_rows {
  static constexpr const char* file = "expert_rows.cu";
  static constexpr const char* function = "choice_rows";
  using params = KernelParams<AnyPointer, int64_t, int64_t, AnyPointer, int64_t, int64_t, int64_t, AnyPointer, int>;
};
struct expert_row_sums {
  static constexpr const char* file = "expert_rows.cu";
  static constexpr const char* function = "expert_row_sums";
  using params = KernelParams<AnyPointer, int64_t, AnyPointer, int64_t, int64_t, int64_t, AnyPointer>;
};

// kernels/gated_units.cu
struct gated_unit_backward {
  static constexpr const char* file = "gated_units.cu";
  static constexpr const char* function = "gated_unit_backward";
  using params = KernelParams<TutelGatedOperands, AnyPointer, int64_t, AnyPointer, int64_t, AnyPointer, int64_t, TutelGatedUnit>;
};
struct gated_unit_forward {
  static constexpr const char* file = "gated_units.cu";
  static constexpr const char* function = "gated_unit_forward";
  using params = KernelParams<TutelGatedOperands, AnyPointer, int64_t, TutelGatedUnit>;
};

// kernels/group_by_expert.cu
struct count_expert_choices {
  static constexpr const char* file = "group_by_expert.cu";
  static constexpr const char* function = "count_expert_choices";
  using params = KernelParams<AnyPointer, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, AnyPointer>;
};
struct place_expert_choices {
  static constexpr const char* file = "group_by_expert.cu";
  static constexpr const char* function = "place_expert_choices";
  using params = KernelParams<AnyPointer, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer>;
};

// kernels/grouped_rows_gemm.cu
struct grouped_rows_product {
  static constexpr const char* file = "grouped_rows_gemm.cu";
  static constexpr const char* function = "grouped_rows_product";
  using params = KernelParams<AnyPointer, int64_t, AnyPointer, int, AnyPointer, AnyPointer, int64_t, int64_t, int64_t, int64_t, AnyPointer>;
};
struct grouped_rows_weight_grad {
  static constexpr const char* file = "grouped_rows_gemm.cu";
  static constexpr const char* function = "grouped_rows_weight_grad";
  using params = KernelParams<AnyPointer, int64_t, AnyPointer, int64_t, AnyPointer, int64_t, int64_t, int64_t, int64_t, int, int, AnyPointer, AnyPointer>;
};

// kernels/quantized_decode.cu
struct quantized_down_fp8_block_scalar {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_down_fp8_block_scalar";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct quantized_down_fp8_block_vector {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_down_fp8_block_vector";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct quantized_down_mxfp4_scalar {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_down_mxfp4_scalar";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct quantized_down_mxfp4_vector {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_down_mxfp4_vector";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct quantized_down_nvfp4_scalar {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_down_nvfp4_scalar";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct quantized_down_nvfp4_vector {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_down_nvfp4_vector";
  using params = KernelParams<AnyPointer, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};
struct quantized_gate_up_fp8_block_scalar {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_gate_up_fp8_block_scalar";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, TutelDecodeUnit, int, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};
struct quantized_gate_up_fp8_block_vector {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_gate_up_fp8_block_vector";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, TutelDecodeUnit, int, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};
struct quantized_gate_up_mxfp4_scalar {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_gate_up_mxfp4_scalar";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, TutelDecodeUnit, int, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};
struct quantized_gate_up_mxfp4_vector {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_gate_up_mxfp4_vector";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, TutelDecodeUnit, int, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};
struct quantized_gate_up_nvfp4_scalar {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_gate_up_nvfp4_scalar";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, TutelDecodeUnit, int, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};
struct quantized_gate_up_nvfp4_vector {
  static constexpr const char* file = "quantized_decode.cu";
  static constexpr const char* function = "quantized_gate_up_nvfp4_vector";
  using params = KernelParams<AnyPointer, int64_t, TutelDecodeRouting, TutelQuantMatrix, AnyPointer, int64_t, TutelDecodeUnit, int, AnyPointer, AnyPointer, int64_t, AnyPointer, int64_t>;
};

// kernels/quantized_grouped_linear.cu
struct quantized_grouped_linear_fp8_block {
  static constexpr const char* file = "quantized_grouped_linear.cu";
  static constexpr const char* function = "quantized_grouped_linear_fp8_block";
  using params = KernelParams<AnyPointer, int64_t, AnyPointer, int64_t, int64_t, TutelQuantMatrix, AnyPointer, AnyPointer, int64_t>;
};
struct quantized_grouped_linear_mxfp4 {
  static constexpr const char* file = "quantized_grouped_linear.cu";
  static constexpr const char* function = "quantized_grouped_linear_mxfp4";
  using params = KernelParams<AnyPointer, int64_t, AnyPointer, int64_t, int64_t, TutelQuantMatrix, AnyPointer, AnyPointer, int64_t>;
};
struct quantized_grouped_linear_nvfp4 {
  static constexpr const char* file = "quantized_grouped_linear.cu";
  static constexpr const char* function = "quantized_grouped_linear_nvfp4";
  using params = KernelParams<AnyPointer, int64_t, AnyPointer, int64_t, int64_t, TutelQuantMatrix, AnyPointer, AnyPointer, int64_t>;
};

// kernels/route_experts.cu
struct route_experts_backward {
  static constexpr const char* file = "route_experts.cu";
  static constexpr const char* function = "route_experts_backward";
  using params = KernelParams<AnyPointer, AnyPointer, AnyPointer, int64_t, int64_t, int64_t, AnyPointer, AnyPointer, int, int, int, double, int, AnyPointer>;
};
struct route_experts_plan {
  static constexpr const char* file = "route_experts.cu";
  static constexpr const char* function = "route_experts_plan";
  using params = KernelParams<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int64_t, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer>;
};
struct route_experts_route {
  static constexpr const char* file = "route_experts.cu";
  static constexpr const char* function = "route_experts_route";
  using params = KernelParams<AnyPointer, int64_t, int64_t, int64_t, int, int, AnyPointer, AnyPointer, int64_t, int64_t, int, double, int, int, int64_t, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer, AnyPointer>;
};

// kernels/routing_topk.cu
struct priority_sort_keys {
  static constexpr const char* file = "routing_topk.cu";
  static constexpr const char* function = "priority_sort_keys";
  using params = KernelParams<AnyPointer, int64_t, AnyPointer>;
};
struct route_topk {
  static constexpr const char* file = "routing_topk.cu";
  static constexpr const char* function = "route_topk";
  using params = KernelParams<AnyPointer, int64_t, int64_t, int64_t, int64_t, AnyPointer, AnyPointer, AnyPointer>;
};

// kernels/slot_assignment.cu
struct assign_slots {
  static constexpr const char* file = "slot_assignment.cu";
  static constexpr const char* function = "assign_slots";
  using params = KernelParams<AnyPointer, AnyPointer, int64_t, int64_t, int64_t, int64_t, int64_t, AnyPointer, AnyPointer>;
};
struct count_choices {
  static constexpr const char* file = "slot_assignment.cu";
  static constexpr const char* function = "count_choices";
  using params = KernelParams<AnyPointer, AnyPointer, int64_t, int64_t, int64_t, int64_t, AnyPointer, TutelErrorSink>;
};
struct scan_choice_counts {
  static constexpr const char* file = "slot_assignment.cu";
  static constexpr const char* function = "scan_choice_counts";
  using params = KernelParams<AnyPointer, int64_t, int64_t, int64_t, AnyPointer>;
};

}  // namespace kernels
}  // namespace cuda
}  // namespace tutel
