#include "kernel_programs.h"

#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <utility>

#include "compile_target.h"
#include "driver.h"
#include "kernel_cache.h"
#include "kernel_sources.h"

namespace tutel {
namespace cuda {
namespace {

constexpr const char* kOptionsFile = "nvrtc_options.txt";

// Everything below is guarded by g_mutex: compiling and loading happen once
// per (device, program), so one lock is plenty.
std::mutex g_mutex;
std::map<std::string, CompiledImage> g_images;                // cache key -> binary
std::map<std::pair<int, std::string>, CUmodule> g_modules;  // (device, cache key) -> module

std::mutex g_warning_mutex;
void (*g_warning_handler)(const std::string&) = nullptr;

void warn_once(const std::string& message) {
  static std::set<std::string> seen;
  void (*handler)(const std::string&) = nullptr;
  {
    std::lock_guard<std::mutex> guard(g_warning_mutex);
    if (!seen.insert(message).second) return;
    handler = g_warning_handler;
  }
  if (handler) handler(message);
  else std::fprintf(stderr, "%s\n", message.c_str());
}

const EmbeddedFile* find_embedded(const std::string& name) {
  for (size_t i = 0; i < kEmbeddedKernelFileCount; ++i)
    if (name == kEmbeddedKernelFiles[i].name) return &kEmbeddedKernelFiles[i];
  return nullptr;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Non-empty lines that are not comments, trimmed.
std::vector<std::string> option_lines(const std::string& text) {
  std::vector<std::string> options;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    start = end + 1;
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    line = line.substr(first, line.find_last_not_of(" \t\r") - first + 1);
    options.push_back(line);
  }
  return options;
}

void hash_text(uint64_t& hash, const std::string& text) {
  const uint64_t size = text.size();
  hash = fnv1a64(&size, sizeof(size), hash);
  hash = fnv1a64(text.data(), text.size(), hash);
}

// Everything the compiled binary depends on.
std::string cache_key(const ProgramSource& program, const CompileTarget& target,
                      std::pair<int, int> nvrtc_version) {
  uint64_t hash = fnv1a64(nullptr, 0);
  hash_text(hash, program.main.name);
  hash_text(hash, program.main.text);
  for (const auto& header : program.headers) {
    hash_text(hash, header.name);
    hash_text(hash, header.text);
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hash));
  std::string key = "tutel kernel v1\nprogram " + program.name + "\nsource " + hex + "\ntarget " +
                    target.name() + "\nnvrtc " + std::to_string(nvrtc_version.first) + "." +
                    std::to_string(nvrtc_version.second) + "\noptions";
  for (const auto& option : program.options) key += " " + option;
  return key + "\n";
}

const KernelDiskCache& disk_cache() {
  static const KernelDiskCache cache(KernelDiskCache::default_directory());
  return cache;
}

// The binary for `key`: from memory, else from disk (unless `fresh`), else
// compiled now.  *from_cache tells whether it was compiled by an earlier call
// or process.
const CompiledImage& image_for(const ProgramSource& program, const CompileTarget& target,
                               const std::string& key, bool fresh, bool* from_cache) {
  *from_cache = true;
  if (!fresh) {
    auto found = g_images.find(key);
    if (found != g_images.end()) return found->second;
    if (auto payload = disk_cache().load(key)) {
      CompiledImage image{std::move(*payload), target.cubin};
      return g_images[key] = std::move(image);
    }
  }
  *from_cache = false;
  std::vector<std::string> options = program.options;
  options.push_back(target.option());
  CompiledImage image = nvrtc().compile(program.main, program.headers, options, target.cubin);
  std::string error;
  if (!disk_cache().store(key, image.binary, &error))
    warn_once("tutel: cannot write the CUDA kernel cache (" + error +
              "); kernels are compiled again in every process. Set TUTEL_KERNEL_CACHE to a "
              "writable directory, or to 'off' to silence this.");
  return g_images[key] = std::move(image);
}

struct LoadAttempt {
  CUresult result = driver_api::kSuccess;
  CUmodule module = nullptr;
  std::string log;
};

LoadAttempt try_load(const CompiledImage& image) {
  LoadAttempt attempt;
  char log[4096] = {0};
  int options[] = {driver_api::kJitErrorLogBuffer, driver_api::kJitErrorLogBufferSizeBytes};
  void* values[] = {log, reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof(log)))};
  attempt.result = driver().cuModuleLoadDataEx(&attempt.module, image.binary.data(), 2, options, values);
  attempt.log = log;
  return attempt;
}

std::string load_failure(const ProgramSource& program, const CompileTarget& target,
                         const LoadAttempt& attempt) {
  const auto version = nvrtc().version();
  std::string message = "tutel: the CUDA driver cannot load " + program.name + ", compiled by NVRTC " +
                        std::to_string(version.first) + "." + std::to_string(version.second) +
                        " for " + target.name() + ": " + describe_driver_error(attempt.result) +
                        ". The driver supports CUDA " + driver_cuda_version() +
                        "; code from a newer NVRTC needs a newer driver, so either update the "
                        "driver or install the NVRTC of the driver's CUDA version (e.g. pip install "
                        "'nvidia-cuda-nvrtc-cu12==12.*' for CUDA 12) and set TUTEL_NVRTC_LIBRARY to it.";
  if (!attempt.log.empty()) message += "\nDriver log:\n" + attempt.log;
  return message;
}

}  // namespace

ProgramSource embedded_program(const std::string& file, const std::string& variant) {
  const EmbeddedFile* main = find_embedded(file);
  const EmbeddedFile* options = find_embedded(kOptionsFile);
  if (main == nullptr || options == nullptr)
    throw std::logic_error("tutel: kernels/" + file + " or kernels/" + kOptionsFile +
                           " was not embedded into the extension");
  ProgramSource program;
  program.name = variant.empty() ? file : file + " [" + variant + "]";
  program.main = SourceFile{file, std::string(main->text, main->size)};
  for (size_t i = 0; i < kEmbeddedKernelFileCount; ++i) {
    const std::string name = kEmbeddedKernelFiles[i].name;
    if (ends_with(name, ".h") || ends_with(name, ".cuh"))
      program.headers.push_back(
          SourceFile{name, std::string(kEmbeddedKernelFiles[i].text, kEmbeddedKernelFiles[i].size)});
  }
  program.options = option_lines(std::string(options->text, options->size));
  if (!variant.empty()) program.options.push_back("-D" + variant);
  return program;
}

CUmodule load_program(int device, const ProgramSource& program) {
  std::lock_guard<std::mutex> guard(g_mutex);
  const Nvrtc& compiler = nvrtc();
  const DeviceProperties& properties = device_properties(device);
  const CompileTarget target = choose_compile_target(
      properties.major, properties.minor, compiler.supported_architectures(), compiler.version());
  if (!target.cubin)
    warn_once("tutel: NVRTC " + std::to_string(compiler.version().first) + "." +
              std::to_string(compiler.version().second) + " does not know compute capability " +
              std::to_string(properties.major) + "." + std::to_string(properties.minor) +
              "; the kernels are built as " + target.name() +
              " PTX, which the driver compiles when loading. A newer nvidia-cuda-nvrtc avoids this.");
  const std::string key = cache_key(program, target, compiler.version());
  const auto found = g_modules.find({device, key});
  if (found != g_modules.end()) return found->second;

  // Loading and allocating are not allowed while a stream is being captured,
  // unless the thread relaxes its capture mode.
  RelaxedCaptureMode relaxed;
  bool from_cache = false;
  LoadAttempt attempt = try_load(image_for(program, target, key, /*fresh=*/false, &from_cache));
  if (attempt.result != driver_api::kSuccess && from_cache) {
    // A cached binary is not trusted further than the driver accepts it.
    attempt = try_load(image_for(program, target, key, /*fresh=*/true, &from_cache));
  }
  if (attempt.result != driver_api::kSuccess) throw DriverError(load_failure(program, target, attempt));
  g_modules[{device, key}] = attempt.module;
  return attempt.module;
}

CUfunction module_function(CUmodule module, const char* function, const std::string& program) {
  CUfunction handle = nullptr;
  const CUresult result = driver().cuModuleGetFunction(&handle, module, function);
  if (result != driver_api::kSuccess)
    throw DriverError(std::string("tutel: kernel ") + function + " not found in " + program + ": " +
                      describe_driver_error(result));
  return handle;
}

std::string kernel_cache_directory() { return disk_cache().directory(); }

void set_warning_handler(void (*handler)(const std::string&)) {
  std::lock_guard<std::mutex> guard(g_warning_mutex);
  g_warning_handler = handler;
}

CUfunction KernelHandle::get(int device) const {
  if (device < 0 || device >= kMaxKernelDevices)
    throw DriverError("tutel: CUDA device index " + std::to_string(device) + " is out of range");
  CUfunction function = resolved_[device].load(std::memory_order_acquire);
  if (function != nullptr) return function;
  const ProgramSource program = embedded_program(file_, variant_);
  function = module_function(load_program(device, program), function_, program.name);
  resolved_[device].store(function, std::memory_order_release);
  return function;
}

}  // namespace cuda
}  // namespace tutel
