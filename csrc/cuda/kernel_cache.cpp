#include "kernel_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

namespace tutel {
namespace cuda {
namespace {

constexpr char kMagic[8] = {'T', 'U', 'T', 'E', 'L', 'K', 'C', '1'};
constexpr size_t kHeaderSize = sizeof(kMagic) + 3 * sizeof(uint64_t);
// Bounds that no real entry reaches; a header claiming more is corrupt.
constexpr uint64_t kMaxKeySize = 1ull << 20;
constexpr uint64_t kMaxPayloadSize = 1ull << 30;

uint64_t entry_checksum(const std::string& key, const std::string& payload) {
  return fnv1a64(payload.data(), payload.size(), fnv1a64(key.data(), key.size()));
}

std::string hex64(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

std::string error_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

// mkdir -p, creating missing directories with mode 0700 (the cache is per user).
bool make_directories(const std::string& path, std::string* error) {
  std::string prefix;
  size_t start = 0;
  while (start <= path.size()) {
    size_t slash = path.find('/', start);
    if (slash == std::string::npos) slash = path.size();
    prefix = path.substr(0, slash);
    start = slash + 1;
    if (prefix.empty()) continue;
    if (mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) {
      if (error) *error = error_text("cannot create", prefix);
      return false;
    }
  }
  struct stat info;
  if (stat(path.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    if (error) *error = path + " is not a directory";
    return false;
  }
  return true;
}

bool write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t written = write(fd, data, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += written;
    size -= size_t(written);
  }
  return true;
}

bool read_file(const std::string& path, std::string* contents) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat info;
  bool ok = fstat(fd, &info) == 0 && uint64_t(info.st_size) <= kHeaderSize + kMaxKeySize + kMaxPayloadSize;
  if (ok) {
    contents->resize(size_t(info.st_size));
    size_t done = 0;
    while (ok && done < contents->size()) {
      const ssize_t got = read(fd, &(*contents)[done], contents->size() - done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) ok = false;
      else done += size_t(got);
    }
  }
  close(fd);
  return ok;
}

// A name no other writer uses at the same time: pid, thread and a counter.
std::string temporary_name(const std::string& final_path) {
  static std::atomic<uint64_t> counter{0};
  const uint64_t thread = std::hash<std::thread::id>()(std::this_thread::get_id());
  return final_path + ".tmp." + std::to_string(getpid()) + "." + hex64(thread) + "." +
         std::to_string(counter.fetch_add(1));
}

}  // namespace

uint64_t fnv1a64(const void* data, size_t size, uint64_t hash) {
  const unsigned char* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= 0x100000001b3ull;
  }
  return hash;
}

std::string KernelDiskCache::default_directory() {
  const char* explicit_dir = std::getenv("TUTEL_KERNEL_CACHE");
  if (explicit_dir != nullptr && *explicit_dir != '\0') {
    const std::string value = explicit_dir;
    return value == "off" || value == "0" ? std::string() : value;
  }
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && *xdg == '/') return std::string(xdg) + "/tutel/kernels";
  const char* home = std::getenv("HOME");
  if (home != nullptr && *home == '/') return std::string(home) + "/.cache/tutel/kernels";
  return std::string();
}

std::string KernelDiskCache::entry_path(const std::string& key) const {
  return directory_ + "/" + hex64(fnv1a64(key.data(), key.size())) + ".bin";
}

std::optional<std::string> KernelDiskCache::load(const std::string& key) const {
  if (!enabled()) return std::nullopt;
  std::string contents;
  if (!read_file(entry_path(key), &contents) || contents.size() < kHeaderSize) return std::nullopt;
  if (std::memcmp(contents.data(), kMagic, sizeof(kMagic)) != 0) return std::nullopt;
  uint64_t fields[3];  // key size, payload size, checksum
  std::memcpy(fields, contents.data() + sizeof(kMagic), sizeof(fields));
  const uint64_t key_size = fields[0], payload_size = fields[1];
  if (key_size > kMaxKeySize || payload_size > kMaxPayloadSize ||
      contents.size() != kHeaderSize + key_size + payload_size)
    return std::nullopt;
  if (key_size != key.size() || contents.compare(kHeaderSize, key_size, key) != 0)
    return std::nullopt;
  std::string payload = contents.substr(kHeaderSize + key_size);
  if (entry_checksum(key, payload) != fields[2]) return std::nullopt;
  return payload;
}

bool KernelDiskCache::store(const std::string& key, const std::string& payload,
                            std::string* error) const {
  if (!enabled()) return true;
  if (!make_directories(directory_, error)) return false;
  const std::string final_path = entry_path(key);
  const std::string temporary = temporary_name(final_path);

  std::string header(kMagic, sizeof(kMagic));
  const uint64_t fields[3] = {key.size(), payload.size(), entry_checksum(key, payload)};
  header.append(reinterpret_cast<const char*>(fields), sizeof(fields));

  const int fd = open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (error) *error = error_text("cannot create", temporary);
    return false;
  }
  bool ok = write_all(fd, header.data(), header.size()) && write_all(fd, key.data(), key.size()) &&
            write_all(fd, payload.data(), payload.size());
  if (!ok && error) *error = error_text("cannot write", temporary);
  if (close(fd) != 0 && ok) {
    ok = false;
    if (error) *error = error_text("cannot write", temporary);
  }
  if (ok && rename(temporary.c_str(), final_path.c_str()) != 0) {
    ok = false;
    if (error) *error = error_text("cannot rename to", final_path);
  }
  if (!ok) unlink(temporary.c_str());
  return ok;
}

}  // namespace cuda
}  // namespace tutel
