// The bfloat16 [O, K] skinny product on AVX512-BF16's dot products (VDPBF16PS: 32 products per
// instruction, neighbouring pairs summed into each float lane, neither operand widened).  Its own
// file so that only this code is compiled for AVX512-BF16: skinny_gemm_avx512.cpp hands it out
// where the CPU has the instructions.
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its own (maybe-)uninitialized
// warnings flag at every inlined use; these files hold nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "skinny_gemm.h"
#include "skinny_prefetch.h"

#ifdef TUTEL_HAVE_SKINNY_PREFETCH
#define TUTEL_SKINNY_DOT_TARGET TUTEL_AVX512_BF16
#include "skinny_avx512_dot.h"

namespace tutel {
namespace gemm {
namespace skinny {
namespace {

// Products are exact in float; each lane adds its pair's two products to its sum in turn, rounding
// to nearest even (and, unlike FMA, treating subnormal inputs and results as zero: values below
// 2^-126, far under bfloat16's own rounding of any sum they enter).
struct Bf16PairDot {
  using Operand = __m512i;
  static constexpr int64_t kStep = 32;
  TUTEL_AVX512_BF16 static Operand load(const bfloat16* p) { return _mm512_loadu_si512(p); }
  TUTEL_AVX512_BF16 static Operand load_first(const bfloat16* p, int64_t n) {
    return _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1u), p);
  }
  TUTEL_AVX512_BF16 static __m512 madd(__m512 acc, Operand w, Operand x) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(w), reinterpret_cast<__m512bh&>(x));
  }
};

}  // namespace

SkinnyKernel<bfloat16> bf16_dot_outputs_by_inner() { return &outputs_by_inner<bfloat16, Bf16PairDot>; }

}  // namespace skinny
}  // namespace gemm
}  // namespace tutel
#endif
