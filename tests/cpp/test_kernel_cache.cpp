// The on-disk kernel cache: round trips, every kind of damaged entry treated
// as absent, atomic replacement, and processes writing one entry at once.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/kernel_cache.h"

using tutel::cuda::fnv1a64;
using tutel::cuda::KernelDiskCache;

namespace {

// A fresh directory under the system temp dir, removed at the end.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/tutel_cache_test_XXXXXX";
    path_ = mkdtemp(pattern);
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

std::vector<std::string> file_names(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* entry = readdir(d))
      if (entry->d_name[0] != '.') names.push_back(entry->d_name);
    closedir(d);
  }
  return names;
}

std::string payload_of(size_t size, unsigned seed) {
  std::string payload(size, '\0');
  for (size_t i = 0; i < size; ++i) payload[i] = char((i * 131 + seed * 7) & 0xff);
  return payload;
}

const std::string kKey = "tutel kernel v1\nprogram dispatch.cu\ntarget sm_90\n";

}  // namespace

TEST(KernelCache, Fnv1aMatchesKnownValues) {
  EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar", 6), 0x85944171f73967e8ull);
  // Continuing from a hash equals hashing the concatenation.
  EXPECT_EQ(fnv1a64("bar", 3, fnv1a64("foo", 3)), fnv1a64("foobar", 6));
}

TEST(KernelCache, StoresAndLoadsEntries) {
  TempDir dir;
  KernelDiskCache cache(dir.path() + "/nested/kernels");
  EXPECT_FALSE(cache.load(kKey).has_value());
  const std::string payload = payload_of(100000, 1) + std::string(3, '\0');  // binary, with NULs
  std::string error;
  ASSERT_TRUE(cache.store(kKey, payload, &error)) << error;
  auto loaded = cache.load(kKey);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(*loaded, payload);
  // Another key is another entry.
  EXPECT_FALSE(cache.load(kKey + "x").has_value());
  ASSERT_TRUE(cache.store(kKey + "x", "other", &error));
  EXPECT_EQ(*cache.load(kKey + "x"), "other");
  EXPECT_EQ(*cache.load(kKey), payload);
  // The directory is private to the user, and no temporary file is left.
  struct stat info;
  ASSERT_EQ(stat((dir.path() + "/nested/kernels").c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0700u);
  for (const auto& name : file_names(dir.path() + "/nested/kernels"))
    EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
  EXPECT_EQ(file_names(dir.path() + "/nested/kernels").size(), 2u);
}

TEST(KernelCache, EmptyPayloadRoundTrips) {
  TempDir dir;
  KernelDiskCache cache(dir.path());
  std::string error;
  ASSERT_TRUE(cache.store(kKey, "", &error)) << error;
  auto loaded = cache.load(kKey);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(*loaded, "");
}

TEST(KernelCache, DamagedEntriesAreTreatedAsAbsent) {
  TempDir dir;
  KernelDiskCache cache(dir.path());
  const std::string payload = payload_of(5000, 2);
  std::string error;
  ASSERT_TRUE(cache.store(kKey, payload, &error)) << error;
  const std::string path = cache.entry_path(kKey);
  const std::string good = read_bytes(path);
  ASSERT_EQ(good.size(), 32 + kKey.size() + payload.size());

  std::vector<std::pair<std::string, std::string>> damaged = {
      {"empty file", ""},
      {"truncated header", good.substr(0, 20)},
      {"truncated payload", good.substr(0, good.size() - 1)},
      {"extra byte", good + "x"},
      {"wrong magic", "X" + good.substr(1)},
  };
  std::string flipped_payload = good;
  flipped_payload[good.size() - 10] ^= 0x01;
  damaged.push_back({"payload bit flip", flipped_payload});
  std::string flipped_key = good;
  flipped_key[32 + 3] ^= 0x20;
  damaged.push_back({"key bit flip", flipped_key});
  std::string huge_size = good;
  huge_size[8 + 8 + 7] = '\x7f';  // payload size field claims petabytes
  damaged.push_back({"absurd size", huge_size});

  for (const auto& [what, bytes] : damaged) {
    write_bytes(path, bytes);
    EXPECT_FALSE(cache.load(kKey).has_value()) << what;
    // Storing again (what the compiler does after a miss) repairs the entry.
    ASSERT_TRUE(cache.store(kKey, payload, &error)) << error;
    auto repaired = cache.load(kKey);
    ASSERT_TRUE(repaired.has_value()) << what;
    EXPECT_EQ(*repaired, payload) << what;
  }
}

TEST(KernelCache, AnEntryForAnotherKeyIsNotTrusted) {
  TempDir dir;
  KernelDiskCache cache(dir.path());
  std::string error;
  ASSERT_TRUE(cache.store("key A", "payload A", &error));
  // Make the file of key B hold key A's entry, as a hash collision would.
  write_bytes(cache.entry_path("key B"), read_bytes(cache.entry_path("key A")));
  EXPECT_FALSE(cache.load("key B").has_value());
  EXPECT_EQ(*cache.load("key A"), "payload A");
}

TEST(KernelCache, DisabledCacheDoesNothing) {
  KernelDiskCache cache("");
  EXPECT_FALSE(cache.enabled());
  std::string error;
  EXPECT_TRUE(cache.store(kKey, "x", &error));
  EXPECT_FALSE(cache.load(kKey).has_value());
}

TEST(KernelCache, UnwritableDirectoryReportsWhy) {
  TempDir dir;
  const std::string file = dir.path() + "/a_file";
  write_bytes(file, "not a directory");
  KernelDiskCache cache(file + "/kernels");
  std::string error;
  EXPECT_FALSE(cache.store(kKey, "x", &error));
  EXPECT_NE(error.find(file), std::string::npos) << error;
  EXPECT_FALSE(cache.load(kKey).has_value());
}

TEST(KernelCache, DefaultDirectoryFollowsTheEnvironment) {
  const char* saved_cache = std::getenv("TUTEL_KERNEL_CACHE");
  const char* saved_xdg = std::getenv("XDG_CACHE_HOME");
  const char* saved_home = std::getenv("HOME");
  const std::string cache_value = saved_cache ? saved_cache : "";
  const std::string xdg_value = saved_xdg ? saved_xdg : "";
  const std::string home_value = saved_home ? saved_home : "";

  setenv("TUTEL_KERNEL_CACHE", "/some/dir", 1);
  EXPECT_EQ(KernelDiskCache::default_directory(), "/some/dir");
  setenv("TUTEL_KERNEL_CACHE", "off", 1);
  EXPECT_EQ(KernelDiskCache::default_directory(), "");
  setenv("TUTEL_KERNEL_CACHE", "0", 1);
  EXPECT_EQ(KernelDiskCache::default_directory(), "");
  unsetenv("TUTEL_KERNEL_CACHE");
  setenv("XDG_CACHE_HOME", "/xdg", 1);
  EXPECT_EQ(KernelDiskCache::default_directory(), "/xdg/tutel/kernels");
  unsetenv("XDG_CACHE_HOME");
  setenv("HOME", "/home/someone", 1);
  EXPECT_EQ(KernelDiskCache::default_directory(), "/home/someone/.cache/tutel/kernels");

  auto restore = [](const char* name, const char* saved, const std::string& value) {
    if (saved) setenv(name, value.c_str(), 1);
    else unsetenv(name);
  };
  restore("TUTEL_KERNEL_CACHE", saved_cache, cache_value);
  restore("XDG_CACHE_HOME", saved_xdg, xdg_value);
  restore("HOME", saved_home, home_value);
}

// Several processes store different payloads for one key while others read
// it: a reader sees no entry or one complete payload, never a mixture.
TEST(KernelCache, ConcurrentProcessesNeverSeeATornEntry) {
  TempDir dir;
  const std::string directory = dir.path() + "/kernels";
  constexpr int kWriters = 4, kReaders = 2, kRounds = 200;
  std::vector<std::string> payloads;
  for (int w = 0; w < kWriters; ++w) payloads.push_back(payload_of(200000 + 1000 * w, 10 + w));

  std::vector<pid_t> children;
  for (int p = 0; p < kWriters + kReaders; ++p) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      KernelDiskCache cache(directory);
      int failures = 0;
      for (int round = 0; round < kRounds; ++round) {
        if (p < kWriters) {
          std::string error;
          if (!cache.store(kKey, payloads[p], &error)) ++failures;
        } else if (auto loaded = cache.load(kKey)) {
          bool known = false;
          for (const auto& payload : payloads) known = known || *loaded == payload;
          if (!known) ++failures;
        }
      }
      _exit(failures == 0 ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  KernelDiskCache cache(directory);
  auto final_entry = cache.load(kKey);
  ASSERT_TRUE(final_entry.has_value());
  bool known = false;
  for (const auto& payload : payloads) known = known || *final_entry == payload;
  EXPECT_TRUE(known);
  EXPECT_EQ(file_names(directory).size(), 1u);  // no temporary files left behind
}
