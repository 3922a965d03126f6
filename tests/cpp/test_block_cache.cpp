// The block cache: reuse of returned blocks, the size rule, the limit (least recently
// returned freed first), release, counters, and concurrent use (also under ASan).
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "core/block_cache.h"

using namespace tutel::core;

namespace {

constexpr size_t kMiB = size_t(1) << 20;

// Each test starts from an empty cache with a known limit (the cache is one per process).
class BlockCache : public ::testing::Test {
 protected:
  void SetUp() override {
    release_cached_blocks();
    set_block_cache_limit(int64_t(64 * kMiB));
  }
  void TearDown() override { release_cached_blocks(); }
};

}  // namespace

TEST_F(BlockCache, ReturnedBlockServesTheNextRequestOfItsSize) {
  const BlockCacheStats before = block_cache_stats();
  Block first = take_block(3 * kMiB);
  ASSERT_NE(first.data, nullptr);
  EXPECT_GE(first.capacity, 3 * kMiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(first.data) % 64, 0u);
  std::memset(first.data, 1, 3 * kMiB);  // the whole block is usable
  EXPECT_EQ(block_cache_stats().live_bytes, before.live_bytes + int64_t(first.capacity));
  give_back_block(first);
  EXPECT_EQ(block_cache_stats().cached_bytes, int64_t(first.capacity));
  Block second = take_block(3 * kMiB);
  EXPECT_EQ(second.data, first.data);
  EXPECT_EQ(second.capacity, first.capacity);
  const BlockCacheStats after = block_cache_stats();
  EXPECT_EQ(after.hits, before.hits + 1);
  EXPECT_EQ(after.misses, before.misses + 1);
  EXPECT_EQ(after.cached_bytes, 0);
  give_back_block(second);
}

TEST_F(BlockCache, ReusesOnlyBlocksAtMostAQuarterLarger) {
  Block big = take_block(8 * kMiB);
  give_back_block(big);
  Block small = take_block(4 * kMiB);  // 8 MiB would waste half: a fresh block
  EXPECT_NE(small.data, big.data);
  Block close = take_block(7 * kMiB);  // 8 <= 7 * 1.25
  EXPECT_EQ(close.data, big.data);
  give_back_block(small);
  give_back_block(close);
}

TEST_F(BlockCache, TakesTheSmallestFittingBlock) {
  Block a = take_block(5 * kMiB), b = take_block(4 * kMiB);
  give_back_block(a);
  give_back_block(b);
  Block c = take_block(4 * kMiB);
  EXPECT_EQ(c.data, b.data);
  give_back_block(c);
}

TEST_F(BlockCache, KeepsWithinTheLimitFreeingTheOldestFirst) {
  set_block_cache_limit(int64_t(10 * kMiB));
  Block a = take_block(4 * kMiB), b = take_block(4 * kMiB), c = take_block(4 * kMiB);
  give_back_block(a);
  give_back_block(b);
  give_back_block(c);  // 12 MiB > 10: a, the oldest, is freed
  EXPECT_EQ(block_cache_stats().cached_bytes, int64_t(b.capacity + c.capacity));
  Block d = take_block(4 * kMiB), e = take_block(4 * kMiB);
  EXPECT_TRUE((d.data == b.data && e.data == c.data) || (d.data == c.data && e.data == b.data));
  EXPECT_EQ(block_cache_stats().cached_bytes, 0);
  give_back_block(d);
  give_back_block(e);
}

TEST_F(BlockCache, BlockLargerThanTheLimitIsFreedAtOnce) {
  set_block_cache_limit(int64_t(2 * kMiB));
  Block big = take_block(3 * kMiB);
  give_back_block(big);
  EXPECT_EQ(block_cache_stats().cached_bytes, 0);
}

TEST_F(BlockCache, LoweringTheLimitOrReleasingFreesCachedBlocks) {
  Block a = take_block(4 * kMiB), b = take_block(2 * kMiB);
  give_back_block(a);
  give_back_block(b);
  set_block_cache_limit(int64_t(3 * kMiB));
  EXPECT_EQ(block_cache_stats().cached_bytes, int64_t(b.capacity));
  EXPECT_EQ(block_cache_stats().limit_bytes, int64_t(3 * kMiB));
  release_cached_blocks();
  EXPECT_EQ(block_cache_stats().cached_bytes, 0);
  set_block_cache_limit(-5);  // negative means keep nothing
  EXPECT_EQ(block_cache_stats().limit_bytes, 0);
}

TEST_F(BlockCache, ConcurrentTakeAndGiveBack) {
  const int64_t live_before = block_cache_stats().live_bytes;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = (1 + (i + t) % 5) * kMiB;
        Block block = take_block(bytes);
        ASSERT_NE(block.data, nullptr);
        std::memset(block.data, t, bytes);  // no two threads hold the same block
        const unsigned char* bytes_seen = static_cast<const unsigned char*>(block.data);
        ASSERT_EQ(bytes_seen[0], t);
        ASSERT_EQ(bytes_seen[bytes - 1], t);
        give_back_block(block);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(block_cache_stats().live_bytes, live_before);
  EXPECT_LE(block_cache_stats().cached_bytes, int64_t(64 * kMiB));
}
