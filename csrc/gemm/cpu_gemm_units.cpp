#include "cpu_gemm_units.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace tutel {
namespace gemm {
namespace {

#if defined(__x86_64__) || defined(__i386__)
// The registers of CPUID leaf 7 (structured extended features), subleaf `sub`; zeros when the CPU
// has no such leaf.
struct Leaf7 {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Leaf7 leaf7(unsigned sub) {
  Leaf7 r;
  if (!__get_cpuid_count(7, sub, &r.eax, &r.ebx, &r.ecx, &r.edx)) return Leaf7{};
  return r;
}
#endif

}  // namespace

bool cpu_gemm_has_wide_fma() {
#if defined(__x86_64__) || defined(__i386__)
  // __builtin_cpu_supports also checks that the OS saves the 512-bit registers.
  static const bool wide = __builtin_cpu_is("intel") && __builtin_cpu_supports("avx512f");
  return wide;
#else
  return false;
#endif
}

bool cpu_gemm_has_bf16_dot() {
#if defined(__x86_64__) || defined(__i386__)
  // AVX512-BF16: leaf 7.1 EAX bit 5; AMX-BF16: leaf 7.0 EDX bit 22.  Both need the OS's AVX-512
  // state, which avx512f's check covers (AMX tiles are asked for by oneDNN itself).
  static const bool native = [] {
    const Leaf7 base = leaf7(0);
    const bool avx512_bf16 = base.eax >= 1 && ((leaf7(1).eax >> 5) & 1u) != 0;  // base.eax: the last subleaf
    const bool amx_bf16 = ((base.edx >> 22) & 1u) != 0;
    return __builtin_cpu_supports("avx512f") && (avx512_bf16 || amx_bf16);
  }();
  return native;
#else
  return false;
#endif
}

}  // namespace gemm
}  // namespace tutel
