#include "block_cache.h"

#include <unistd.h>

#include <cstdlib>
#include <iterator>
#include <list>
#include <map>
#include <mutex>

namespace tutel {
namespace core {
namespace {

constexpr size_t kAlignment = 64;
constexpr size_t kGranule = size_t(64) << 10;  // fresh blocks are rounded up to 64 KiB

// A quarter of the machine's memory, unless TUTEL_HOST_CACHE_BYTES says otherwise.
int64_t default_limit() {
  if (const char* text = std::getenv("TUTEL_HOST_CACHE_BYTES")) {
    char* end = nullptr;
    const long long value = std::strtoll(text, &end, 10);
    if (end != text && *end == '\0' && value >= 0) return value;
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page / 4 : int64_t(1) << 30;
}

class BlockCache {
 public:
  Block take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto fit = by_size_.lower_bound(bytes);
      if (fit != by_size_.end() && fit->first <= bytes + bytes / 4) {
        const Block block = *fit->second;
        free_.erase(fit->second);
        by_size_.erase(fit);
        cached_ -= int64_t(block.capacity);
        live_ += int64_t(block.capacity);
        ++hits_;
        return block;
      }
      ++misses_;
    }
    const size_t capacity = (bytes + kGranule - 1) / kGranule * kGranule;
    void* data = nullptr;
    if (posix_memalign(&data, kAlignment, capacity) != 0) return {nullptr, 0};
    std::lock_guard<std::mutex> lock(mutex_);
    live_ += int64_t(capacity);
    return {data, capacity};
  }

  void give_back(Block block) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_ -= int64_t(block.capacity);
    if (int64_t(block.capacity) > limit_) {
      std::free(block.data);
      return;
    }
    free_.push_back(block);
    by_size_.emplace(block.capacity, std::prev(free_.end()));
    cached_ += int64_t(block.capacity);
    trim_to(limit_);
  }

  void set_limit(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes < 0 ? 0 : bytes;
    trim_to(limit_);
  }

  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    trim_to(0);
  }

  BlockCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {cached_, live_, hits_, misses_, limit_};
  }

 private:
  // Frees the least recently returned blocks until at most `bytes` stay cached.
  void trim_to(int64_t bytes) {
    while (cached_ > bytes && !free_.empty()) {
      const auto oldest = free_.begin();
      auto range = by_size_.equal_range(oldest->capacity);
      for (auto entry = range.first; entry != range.second; ++entry) {
        if (entry->second == oldest) {
          by_size_.erase(entry);
          break;
        }
      }
      cached_ -= int64_t(oldest->capacity);
      std::free(oldest->data);
      free_.erase(oldest);
    }
  }

  std::mutex mutex_;
  std::list<Block> free_;                                  // least recently returned first
  std::multimap<size_t, std::list<Block>::iterator> by_size_;  // the same blocks by capacity
  int64_t cached_ = 0, live_ = 0, hits_ = 0, misses_ = 0;
  int64_t limit_ = default_limit();
};

// Never destroyed: tensors freed while the process exits still give their blocks back.
BlockCache& cache() {
  static BlockCache* instance = new BlockCache();
  return *instance;
}

}  // namespace

Block take_block(size_t bytes) { return cache().take(bytes); }
void give_back_block(Block block) { cache().give_back(block); }
void release_cached_blocks() { cache().release(); }
void set_block_cache_limit(int64_t bytes) { cache().set_limit(bytes); }
BlockCacheStats block_cache_stats() { return cache().stats(); }

}  // namespace core
}  // namespace tutel
