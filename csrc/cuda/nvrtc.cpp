#include "nvrtc.h"

#include "nvrtc_api.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <dirent.h>
#include <mutex>
#include <sstream>

namespace tutel {
namespace cuda {

struct Nvrtc::Api : nvrtc_api::Functions {};

namespace {

// Library names tried in every directory and then on the system search path,
// newest first.
const char* const kLibraryNames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2",
                                     "libnvrtc.so"};

bool is_file(const std::string& path) {
  struct stat info;
  return stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

bool is_directory(const std::string& path) {
  struct stat info;
  return stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

std::string directory_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// NVRTC opens its builtins library (libnvrtc-builtins.so.X.Y) by name when it
// first compiles; a copy from a pip wheel is not on the loader's path, so it
// is opened here first, from the directory NVRTC itself came from.
void preload_builtins(const std::string& directory) {
  DIR* dir = opendir(directory.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> found;
  while (struct dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind("libnvrtc-builtins.so.", 0) == 0 && name.find(".alt.") == std::string::npos)
      found.push_back(directory + "/" + name);
  }
  closedir(dir);
  std::sort(found.begin(), found.end());
  static std::vector<std::unique_ptr<DynamicLibrary>> kept;  // loaded for the process
  for (const auto& path : found) {
    std::string ignored;
    if (auto library = DynamicLibrary::open(path, /*global=*/true, &ignored)) kept.push_back(std::move(library));
  }
}

std::string how_to_install() {
  std::ostringstream out;
  const char* cuda_home = std::getenv("CUDA_HOME");
  out << "Fix it with one of:\n"
      << "  pip install nvidia-cuda-nvrtc     (CUDA 13; nvidia-cuda-nvrtc-cu12 for CUDA 12), into "
         "this Python environment;\n"
      << "  set CUDA_HOME to a CUDA toolkit whose lib64/ holds libnvrtc.so";
  if (cuda_home == nullptr) {
    out << " (CUDA_HOME is not set)";
  } else if (!is_directory(cuda_home)) {
    out << " (CUDA_HOME=" << cuda_home << " does not exist)";
  } else {
    out << " (CUDA_HOME=" << cuda_home << " has no libnvrtc in lib64/ or lib/)";
  }
  out << ";\n  set TUTEL_NVRTC_LIBRARY to the full path of libnvrtc.so.";
  return out.str();
}

}  // namespace

Nvrtc::Nvrtc(std::unique_ptr<DynamicLibrary> library, std::unique_ptr<Api> api)
    : library_(std::move(library)), api_(std::move(api)), path_(library_->file_path()) {}

Nvrtc::~Nvrtc() = default;

std::unique_ptr<Nvrtc> Nvrtc::load(const std::vector<std::string>& search_dirs) {
  std::vector<std::string> candidates;
  const char* explicit_path = std::getenv("TUTEL_NVRTC_LIBRARY");
  if (explicit_path != nullptr && *explicit_path != '\0') {
    candidates.push_back(explicit_path);
  } else {
    for (const auto& dir : search_dirs)
      for (const char* name : kLibraryNames)
        if (is_file(dir + "/" + name)) candidates.push_back(dir + "/" + name);
    for (const char* name : kLibraryNames) candidates.push_back(name);
  }

  std::ostringstream tried;
  for (const auto& candidate : candidates) {
    std::string error;
    auto library = DynamicLibrary::open(candidate, /*global=*/false, &error);
    if (!library) {
      tried << "  " << candidate << ": " << error << "\n";
      continue;
    }
    auto api = std::make_unique<Api>();
#define TUTEL_RESOLVE(name, result, params) library->resolve(#name, api->name, "NVRTC");
    TUTEL_NVRTC_FUNCTIONS(TUTEL_RESOLVE)
#undef TUTEL_RESOLVE
    std::unique_ptr<Nvrtc> loaded(new Nvrtc(std::move(library), std::move(api)));
    preload_builtins(directory_of(loaded->library_path()));
    return loaded;
  }
  throw NvrtcError(
      "tutel: cannot load NVRTC, the CUDA runtime compiler that builds tutel's CUDA kernels on "
      "first use.\nTried:\n" +
      tried.str() + how_to_install());
}

void Nvrtc::check(int result, const char* call) const {
  if (result == 0) return;
  throw NvrtcError(std::string("tutel: ") + call + " failed: " + api_->nvrtcGetErrorString(result) +
                   " (NVRTC at " + path_ + ")");
}

std::pair<int, int> Nvrtc::version() const {
  int major = 0, minor = 0;
  check(api_->nvrtcVersion(&major, &minor), "nvrtcVersion");
  return {major, minor};
}

std::vector<int> Nvrtc::supported_architectures() const {
  int count = 0;
  check(api_->nvrtcGetNumSupportedArchs(&count), "nvrtcGetNumSupportedArchs");
  std::vector<int> archs(count);
  if (count > 0) check(api_->nvrtcGetSupportedArchs(archs.data()), "nvrtcGetSupportedArchs");
  std::sort(archs.begin(), archs.end());
  return archs;
}

CompiledImage Nvrtc::compile(const SourceFile& program, const std::vector<SourceFile>& headers,
                             const std::vector<std::string>& options, bool cubin) const {
  std::vector<const char*> header_texts, header_names, option_texts;
  for (const auto& header : headers) {
    header_texts.push_back(header.text.c_str());
    header_names.push_back(header.name.c_str());
  }
  for (const auto& option : options) option_texts.push_back(option.c_str());

  nvrtc_api::Program handle = nullptr;
  check(api_->nvrtcCreateProgram(&handle, program.text.c_str(), program.name.c_str(),
                                 int(headers.size()), header_texts.data(), header_names.data()),
        "nvrtcCreateProgram");
  struct Destroy {
    const Api* api;
    nvrtc_api::Program* handle;
    ~Destroy() { api->nvrtcDestroyProgram(handle); }
  } destroy{api_.get(), &handle};

  const int result = api_->nvrtcCompileProgram(handle, int(option_texts.size()), option_texts.data());
  if (result != 0) {
    size_t log_size = 0;
    std::string log;
    if (api_->nvrtcGetProgramLogSize(handle, &log_size) == 0 && log_size > 1) {
      log.resize(log_size);
      api_->nvrtcGetProgramLog(handle, &log[0]);
      log.resize(log_size - 1);
    }
    std::ostringstream message;
    message << "tutel: NVRTC failed to compile " << program.name << " ("
            << api_->nvrtcGetErrorString(result) << ") with options:";
    for (const auto& option : options) message << " " << option;
    message << "\n" << log;
    throw NvrtcError(message.str());
  }

  CompiledImage image;
  image.is_cubin = cubin;
  size_t size = 0;
  if (cubin) {
    check(api_->nvrtcGetCUBINSize(handle, &size), "nvrtcGetCUBINSize");
    image.binary.resize(size);
    check(api_->nvrtcGetCUBIN(handle, &image.binary[0]), "nvrtcGetCUBIN");
  } else {
    check(api_->nvrtcGetPTXSize(handle, &size), "nvrtcGetPTXSize");
    image.binary.resize(size);  // includes the terminating NUL the driver needs
    check(api_->nvrtcGetPTX(handle, &image.binary[0]), "nvrtcGetPTX");
  }
  return image;
}

namespace {
std::mutex g_nvrtc_mutex;
std::vector<std::string> g_search_dirs;
std::unique_ptr<Nvrtc> g_nvrtc;
}  // namespace

void set_nvrtc_search_dirs(std::vector<std::string> dirs) {
  std::lock_guard<std::mutex> guard(g_nvrtc_mutex);
  g_search_dirs = std::move(dirs);
}

const Nvrtc& nvrtc() {
  std::lock_guard<std::mutex> guard(g_nvrtc_mutex);
  if (!g_nvrtc) g_nvrtc = Nvrtc::load(g_search_dirs);
  return *g_nvrtc;
}

}  // namespace cuda
}  // namespace tutel
