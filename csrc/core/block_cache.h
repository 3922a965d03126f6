// A cache of large memory blocks, so that buffers of the same sizes, allocated and
// freed every step (an MoE layer's dispatched rows, expert products and their
// gradients), come back without the system's help.
//
// Why: the C library returns blocks of more than 32 MiB to the kernel on free, and
// the next allocation of the same size faults in every page again (one fault and
// one zeroed 4-KiB page each).  A training step of a Qwen3-like layer at 2048
// tokens allocates about 850 MB that way: ~210 000 faults, a quarter of its time
// on two cores.  Blocks given back here stay mapped for the next request.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tutel {
namespace core {

struct BlockCacheStats {
  int64_t cached_bytes;  // held, free for the next request
  int64_t live_bytes;    // handed out and not yet given back
  int64_t hits;          // requests served from the cache
  int64_t misses;        // requests that allocated a new block
  int64_t limit_bytes;   // most bytes kept free (0: nothing kept)
};

// One block handed out: `data` holds at least the bytes asked for, `capacity` its true size
// (pass both back to give_back_block).
struct Block {
  void* data;
  size_t capacity;
};

// A block of at least `bytes` bytes, 64-byte aligned: a cached one no more than a quarter
// larger when there is one, else a fresh one.  Returns {nullptr, 0} when the system has no
// memory.  Thread-safe.
Block take_block(size_t bytes);

// Returns a block from take_block.  Kept for reuse while the free bytes stay within the
// limit (the least recently returned ones are freed first), else freed.  Thread-safe.
void give_back_block(Block block);

// Frees every cached block (blocks in use are not touched).
void release_cached_blocks();

// Sets the most free bytes the cache keeps (0: keep none), freeing blocks beyond it.
void set_block_cache_limit(int64_t bytes);

BlockCacheStats block_cache_stats();

}  // namespace core
}  // namespace tutel
