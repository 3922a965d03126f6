// Opening shared libraries at run time (dlopen).  The CUDA driver and NVRTC
// are opened this way, so a missing library becomes a clear error when a CUDA
// operator first needs it, not an import failure of the whole extension.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>

namespace tutel {
namespace cuda {

class DynamicLibrary {
 public:
  // Opens `path` (a file path, or a bare name searched the system's way).
  // Returns nullptr and sets *error to the loader's message on failure.  The
  // library stays loaded for the life of the process: its functions may be
  // called until exit.
  static std::unique_ptr<DynamicLibrary> open(const std::string& path, bool global,
                                              std::string* error);

  // The symbol's address, or nullptr if the library has no such symbol.
  void* symbol(const char* name) const;

  // Resolves `name` into `out`; throws std::runtime_error naming `what` (the
  // library, for the message) when it is missing.
  template <class Fn>
  void resolve(const char* name, Fn*& out, const char* what) const {
    out = reinterpret_cast<Fn*>(symbol(name));
    if (out == nullptr)
      throw std::runtime_error(std::string("tutel: ") + what + " at " + file_path() +
                               " has no function " + name + "; it is too old or not " + what);
  }

  // The file the library was loaded from.
  std::string file_path() const;

 private:
  explicit DynamicLibrary(void* handle) : handle_(handle) {}
  void* handle_;
};

}  // namespace cuda
}  // namespace tutel
