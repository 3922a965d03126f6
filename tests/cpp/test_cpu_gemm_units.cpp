// core/cpu_gemm_units.h reads CPUID bits by hand; the Linux kernel's own reading of the same bits
// (the flags of /proc/cpuinfo) is the reference.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "core/cpu_gemm_units.h"

namespace {

// The first processor's flags, or an empty set where /proc/cpuinfo has none (not Linux on x86).
std::set<std::string> kernel_cpu_flags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string flag; words >> flag;) flags.insert(flag);
    return flags;
  }
  return {};
}

std::string cpu_vendor() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line))
    if (line.rfind("vendor_id", 0) == 0) return line.substr(line.find(':') + 2);
  return {};
}

}  // namespace

TEST(CpuGemmUnits, Bf16DotMatchesTheKernelsFlags) {
  const std::set<std::string> flags = kernel_cpu_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this system";
  const bool expected = flags.count("avx512f") && (flags.count("avx512_bf16") || flags.count("amx_bf16"));
  EXPECT_EQ(tutel::core::cpu_gemm_has_bf16_dot(), expected);
}

TEST(CpuGemmUnits, WideFmaMeansIntelWithAvx512) {
  const std::set<std::string> flags = kernel_cpu_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this system";
  const bool expected = cpu_vendor() == "GenuineIntel" && flags.count("avx512f");
  EXPECT_EQ(tutel::core::cpu_gemm_has_wide_fma(), expected);
}
