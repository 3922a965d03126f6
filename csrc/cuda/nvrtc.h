// NVRTC, the CUDA runtime compiler, opened with dlopen.  Framework-free, and
// no CUDA header is needed to build it (see nvrtc_api.h).
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dynamic_library.h"

namespace tutel {
namespace cuda {

// NVRTC is missing or unusable, or a program failed to compile.
class NvrtcError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SourceFile {
  std::string name;
  std::string text;
};

// What NVRTC produced: a CUBIN for one architecture, or PTX (NUL-terminated
// text) that the driver compiles for the device when it loads it.
struct CompiledImage {
  std::string binary;
  bool is_cubin = true;
};

class Nvrtc {
 public:
  ~Nvrtc();

  // Opens NVRTC: the file named by $TUTEL_NVRTC_LIBRARY if set; otherwise the
  // first libnvrtc found in `search_dirs` (in order), then the system's
  // library search path.  Throws NvrtcError that lists what was tried and how
  // to install NVRTC.
  static std::unique_ptr<Nvrtc> load(const std::vector<std::string>& search_dirs);

  // (major, minor), e.g. (13, 0).
  std::pair<int, int> version() const;

  // Architectures NVRTC can build CUBINs for, as 10 * major + minor, ascending.
  std::vector<int> supported_architectures() const;

  const std::string& library_path() const { return path_; }

  // Compiles `program` (which may #include the `headers` by name) and returns
  // a CUBIN (`cubin`) or PTX.  Throws NvrtcError with the compiler log.
  CompiledImage compile(const SourceFile& program, const std::vector<SourceFile>& headers,
                        const std::vector<std::string>& options, bool cubin) const;

 private:
  struct Api;
  Nvrtc(std::unique_ptr<DynamicLibrary> library, std::unique_ptr<Api> api);
  void check(int result, const char* call) const;

  std::unique_ptr<DynamicLibrary> library_;
  std::unique_ptr<Api> api_;
  std::string path_;
};

// Directories searched first for NVRTC by nvrtc() (set from Python, see
// tutel/cuda_libraries.py).  Takes effect until NVRTC has been loaded.
void set_nvrtc_search_dirs(std::vector<std::string> dirs);

// The process-wide NVRTC, opened on first use.  Throws NvrtcError if missing
// (and tries again on the next call, so installing it fixes a live process).
const Nvrtc& nvrtc();

}  // namespace cuda
}  // namespace tutel
