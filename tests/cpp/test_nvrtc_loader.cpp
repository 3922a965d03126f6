// The NVRTC loader and the choice of compile target, without a GPU: a missing
// NVRTC gives instructions, a GPU too old or too new for NVRTC is handled,
// and (when NVRTC is installed) a program compiles through the same code the
// extension uses at run time, with compiler errors reported with their log.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/compile_target.h"
#include "cuda/nvrtc.h"

using tutel::cuda::choose_compile_target;
using tutel::cuda::CompileTarget;
using tutel::cuda::Nvrtc;
using tutel::cuda::NvrtcError;

namespace {

// Sets an environment variable for the scope of one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

std::vector<std::string> split_dirs(const std::string& text) {
  std::vector<std::string> dirs;
  std::stringstream in(text);
  std::string dir;
  while (std::getline(in, dir, ':'))
    if (!dir.empty()) dirs.push_back(dir);
  return dirs;
}

// Directories CMake found with tutel/cuda_libraries.py (the pip wheel, CUDA_HOME).
std::vector<std::string> test_nvrtc_dirs() {
#ifdef TUTEL_TEST_NVRTC_DIRS
  return split_dirs(TUTEL_TEST_NVRTC_DIRS);
#else
  return {};
#endif
}

bool under_sanitizer() {
#if defined(__SANITIZE_ADDRESS__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TEST(CompileTarget, ExactArchitectureGivesACubin) {
  const std::vector<int> supported = {75, 80, 86, 89, 90, 100, 120};
  CompileTarget target = choose_compile_target(9, 0, supported, {13, 0});
  EXPECT_TRUE(target.cubin);
  EXPECT_EQ(target.arch, 90);
  EXPECT_EQ(target.option(), "--gpu-architecture=sm_90");
  EXPECT_EQ(choose_compile_target(8, 6, supported, {13, 0}).name(), "sm_86");
}

TEST(CompileTarget, UnknownNewerGpuGetsPtxOfTheNewestOlderArchitecture) {
  const std::vector<int> supported = {75, 80, 86, 90};
  CompileTarget target = choose_compile_target(10, 3, supported, {12, 4});
  EXPECT_FALSE(target.cubin);
  EXPECT_EQ(target.name(), "compute_90");
  // A minor version NVRTC does not list falls back within the family too.
  EXPECT_EQ(choose_compile_target(8, 7, supported, {12, 4}).name(), "compute_86");
}

TEST(CompileTarget, GpuOlderThanNvrtcSupportsIsAClearError) {
  try {
    choose_compile_target(6, 0, {75, 80, 90}, {13, 0});
    FAIL() << "expected NvrtcError";
  } catch (const NvrtcError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("compute capability 6.0"), std::string::npos) << message;
    EXPECT_NE(message.find("NVRTC 13.0"), std::string::npos) << message;
    EXPECT_NE(message.find("sm_75"), std::string::npos) << message;
  }
}

TEST(NvrtcLoader, MissingLibraryExplainsHowToInstallIt) {
  ScopedEnv library("TUTEL_NVRTC_LIBRARY", "/nonexistent/libnvrtc.so.13");
  ScopedEnv home("CUDA_HOME", "/nonexistent/cuda");
  try {
    Nvrtc::load({"/also/nonexistent"});
    FAIL() << "expected NvrtcError";
  } catch (const NvrtcError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("cannot load NVRTC"), std::string::npos) << message;
    EXPECT_NE(message.find("/nonexistent/libnvrtc.so.13"), std::string::npos) << message;
    EXPECT_NE(message.find("pip install nvidia-cuda-nvrtc"), std::string::npos) << message;
    EXPECT_NE(message.find("CUDA_HOME=/nonexistent/cuda does not exist"), std::string::npos) << message;
    EXPECT_NE(message.find("TUTEL_NVRTC_LIBRARY"), std::string::npos) << message;
  }
}

TEST(NvrtcLoader, CompilesThroughTheRuntimePath) {
  if (under_sanitizer()) GTEST_SKIP() << "NVRTC is not built with the sanitizer";
  ScopedEnv library("TUTEL_NVRTC_LIBRARY", nullptr);
  std::unique_ptr<Nvrtc> nvrtc;
  try {
    nvrtc = Nvrtc::load(test_nvrtc_dirs());
  } catch (const NvrtcError& e) {
    GTEST_SKIP() << "NVRTC is not installed: " << e.what();
  }
  const auto version = nvrtc->version();
  EXPECT_GE(version.first, 11);
  const auto archs = nvrtc->supported_architectures();
  ASSERT_FALSE(archs.empty());
  EXPECT_TRUE(std::is_sorted(archs.begin(), archs.end()));

  // A program that includes a header by name, with a define.
  const tutel::cuda::SourceFile header{"scale.cuh", "#define SCALE(x) ((x) * FACTOR)\n"};
  const tutel::cuda::SourceFile program{
      "scale.cu",
      "#include \"scale.cuh\"\n"
      "extern \"C\" __global__ void scale(float* x) { x[threadIdx.x] = SCALE(x[threadIdx.x]); }\n"};
  const std::vector<std::string> options = {"--std=c++17", "-DFACTOR=3.0f",
                                            "--gpu-architecture=sm_" + std::to_string(archs.back())};
  auto cubin = nvrtc->compile(program, {header}, options, /*cubin=*/true);
  EXPECT_TRUE(cubin.is_cubin);
  ASSERT_GT(cubin.binary.size(), 4u);
  EXPECT_EQ(cubin.binary.substr(0, 4), "\x7f" "ELF");
  EXPECT_NE(cubin.binary.find("scale"), std::string::npos);

  const std::vector<std::string> ptx_options = {"-DFACTOR=3.0f", "--gpu-architecture=compute_" +
                                                                     std::to_string(archs.front())};
  auto ptx = nvrtc->compile(program, {header}, ptx_options, /*cubin=*/false);
  EXPECT_FALSE(ptx.is_cubin);
  EXPECT_NE(ptx.binary.find(".entry scale"), std::string::npos);
  EXPECT_EQ(ptx.binary.back(), '\0');  // the driver needs the terminating NUL

  try {
    nvrtc->compile({"broken.cu", "extern \"C\" __global__ void f() { not_declared(); }"}, {},
                   options, true);
    FAIL() << "expected NvrtcError";
  } catch (const NvrtcError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("broken.cu"), std::string::npos) << message;
    EXPECT_NE(message.find("not_declared"), std::string::npos) << message;
  }
}
