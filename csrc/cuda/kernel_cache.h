// The on-disk cache of compiled kernels (framework-free, tested by
// tests/cpp/test_kernel_cache.cpp).
//
// One file per compiled program, named after a hash of its key; the key spells
// out everything the binary depends on (source, options, target architecture,
// NVRTC version).  A file holds
//
//   "TUTELKC1" | key size | payload size | checksum | key | payload
//
// (sizes and the FNV-1a 64 checksum of key + payload as native 64-bit
// integers).  Files are written to a temporary name in the same directory and
// renamed over the final name; rename is atomic, so a reader sees a complete
// old file, a complete new one, or none, even with processes compiling at the
// same moment.  A file whose size, key or checksum does not match is treated
// as absent: the caller compiles again and overwrites it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace tutel {
namespace cuda {

// 64-bit FNV-1a hash of `size` bytes, continuing from `hash`.
uint64_t fnv1a64(const void* data, size_t size, uint64_t hash = 0xcbf29ce484222325ull);

class KernelDiskCache {
 public:
  // A cache in `directory`; an empty directory makes a disabled cache (every
  // load misses and stores do nothing).
  explicit KernelDiskCache(std::string directory) : directory_(std::move(directory)) {}

  // The per-user default: $TUTEL_KERNEL_CACHE if set (the value "off" or "0"
  // disables the disk cache), else $XDG_CACHE_HOME/tutel/kernels, else
  // $HOME/.cache/tutel/kernels; empty (disabled) if none of these is known.
  static std::string default_directory();

  const std::string& directory() const { return directory_; }
  bool enabled() const { return !directory_.empty(); }

  // The file that holds (or would hold) the entry for `key`.
  std::string entry_path(const std::string& key) const;

  // The payload stored for `key`; nullopt when there is no entry or the file
  // is not a complete, intact entry for exactly this key.
  std::optional<std::string> load(const std::string& key) const;

  // Writes the entry atomically (creating the directory, mode 0700, if
  // needed).  Returns false and describes the problem in *error when the
  // directory cannot be created or written: the caller goes on without it.
  bool store(const std::string& key, const std::string& payload, std::string* error) const;

 private:
  std::string directory_;
};

}  // namespace cuda
}  // namespace tutel
