#include "cpu_gemm_switch.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <string>

namespace tutel {
namespace ops {
namespace {

constexpr const char* kVariable = "TUTEL_CPU_GEMM";
constexpr int kUnread = -1;

// The choice as an int (CpuGemm's value), kUnread until the first call reads the environment.
std::atomic<int> g_choice{kUnread};

const char* name_of(CpuGemm choice) { return choice == CpuGemm::kTorch ? "torch" : "tutel"; }

// `text` as a choice (case and surrounding blanks ignored; empty: the default); `what` names the
// source in the error.
CpuGemm parse(const std::string& text, const std::string& what) {
  const auto blank = [](unsigned char c) { return std::isspace(c) != 0; };
  std::string value(std::find_if_not(text.begin(), text.end(), blank), text.end());
  value.erase(std::find_if_not(value.rbegin(), value.rend(), blank).base(), value.end());
  std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (value.empty() || value == "tutel") return CpuGemm::kTutel;
  TORCH_CHECK_VALUE(value == "torch", what, " = '", text, "' is not a CPU GEMM; allowed: 'tutel' (tutel's ",
                    "skinny and tile products, the default) or 'torch' (PyTorch's GEMM for every expert product)");
  return CpuGemm::kTorch;
}

}  // namespace

CpuGemm cpu_gemm() {
  const int choice = g_choice.load(std::memory_order_relaxed);
  if (choice != kUnread) return CpuGemm(choice);
  const char* text = std::getenv(kVariable);
  int read = int(parse(text ? text : "", kVariable));
  // A choice set meanwhile wins over the environment.
  int expected = kUnread;
  if (!g_choice.compare_exchange_strong(expected, read, std::memory_order_relaxed)) read = expected;
  return CpuGemm(read);
}

void register_cpu_gemm_functions(pybind11::module_& m) {
  m.def(
      "_cpu_gemm", [] { return std::string(name_of(cpu_gemm())); },
      "The GEMM the CPU expert products run on: 'tutel' or 'torch' (see tutel.ops.cpu_gemm).");
  m.def(
      "_set_cpu_gemm",
      [](const std::string& name) {
        g_choice.store(int(parse(name, "tutel.ops.cpu_gemm.set_cpu_gemm: `name`")), std::memory_order_relaxed);
      },
      "Makes the CPU expert products run on 'tutel' or 'torch' from now on (see tutel.ops.cpu_gemm).",
      pybind11::arg("name"));
}

}  // namespace ops
}  // namespace tutel
