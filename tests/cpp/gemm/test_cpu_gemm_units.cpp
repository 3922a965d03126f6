// gemm/cpu_gemm_units.h reads CPUID bits by hand; the Linux kernel's own reading of the same bits
// (the flags of /proc/cpuinfo) is the reference.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "gemm/cpu_gemm_units.h"

namespace {

// The value of the first processor's `field` line in /proc/cpuinfo; empty where there is none (not
// Linux on x86).
std::string cpuinfo_field(const std::string& field) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    const size_t colon = line.find(':');
    if (line.rfind(field, 0) == 0 && colon != std::string::npos) {
      const size_t value = line.find_first_not_of(" \t", colon + 1);
      return value == std::string::npos ? std::string() : line.substr(value);
    }
  }
  return {};
}

std::set<std::string> kernel_cpu_flags() {
  std::istringstream words(cpuinfo_field("flags"));
  std::set<std::string> flags;
  for (std::string flag; words >> flag;) flags.insert(flag);
  return flags;
}

}  // namespace

TEST(CpuGemmUnits, Bf16DotMatchesTheKernelsFlags) {
  const std::set<std::string> flags = kernel_cpu_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this system";
  const bool expected = flags.count("avx512f") && (flags.count("avx512_bf16") || flags.count("amx_bf16"));
  EXPECT_EQ(tutel::gemm::cpu_gemm_has_bf16_dot(), expected);
}

TEST(CpuGemmUnits, WideFmaMeansIntelWithAvx512) {
  const std::set<std::string> flags = kernel_cpu_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this system";
  const bool expected = cpuinfo_field("vendor_id") == "GenuineIntel" && flags.count("avx512f");
  EXPECT_EQ(tutel::gemm::cpu_gemm_has_wide_fma(), expected);
}
