// What PyTorch's CPU GEMM can use on this CPU that tutel's AVX2 skinny products cannot: where it
// multiplies at several times their rate, it overtakes them at fewer rows per product (policy.h's
// lines).  Read from CPUID once; false off x86.
#pragma once

namespace tutel {
namespace gemm {

// Whether float32 GEMMs run on 512-bit FMA units at full width: Intel's cores with AVX-512F
// (AMD's Zen 4 also executes AVX-512, but at the 256-bit units' rate).
bool cpu_gemm_has_wide_fma();

// Whether bfloat16 GEMMs multiply bfloat16 natively (AVX512-BF16 or AMX-BF16), rather than
// widening both operands to float first.
bool cpu_gemm_has_bf16_dot();

}  // namespace gemm
}  // namespace tutel
