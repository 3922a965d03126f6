#include "dynamic_library.h"

#include <dlfcn.h>
#include <link.h>

namespace tutel {
namespace cuda {

std::unique_ptr<DynamicLibrary> DynamicLibrary::open(const std::string& path, bool global,
                                                     std::string* error) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | (global ? RTLD_GLOBAL : RTLD_LOCAL));
  if (handle == nullptr) {
    const char* message = dlerror();
    if (error) *error = message ? message : "unknown dlopen error";
    return nullptr;
  }
  return std::unique_ptr<DynamicLibrary>(new DynamicLibrary(handle));
}

void* DynamicLibrary::symbol(const char* name) const { return dlsym(handle_, name); }

std::string DynamicLibrary::file_path() const {
  struct link_map* map = nullptr;
  if (dlinfo(handle_, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr)
    return map->l_name;
  return "(unknown path)";
}

}  // namespace cuda
}  // namespace tutel
