// The emulation's cross-block schedules and weak memory (cuda_emulation.h) on small kernels of
// its own: a missing fence before the atomic that hands data to another block gives stale data
// under weak memory (and only there), blocks keep their own __shared__ memory (that of function
// templates included) while interleaved, spin waits let other blocks run, and blocks that wait
// for one another for ever fail the launch.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "../../../kernels/kernel_abi.h"
#include "cuda_emulation.h"

// Kernels at global scope, as kernels/*.cu's are (the emulation finds templates' __shared__
// variables by that).

// Thread 0 of every block stores its value, fences (if asked) and counts its block done; the
// block that completes the count sums every block's value.
void publish_then_count(const int* values, int* slots, int* count, int* total, bool fence) {
  __shared__ int last;
  if (threadIdx.x == 0) {
    slots[blockIdx.x] = values[blockIdx.x];
    if (fence) __threadfence();
    last = atomicAdd(count, 1) == int(gridDim.x) - 1;
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    int sum = 0;
    for (unsigned b = 0; b < gridDim.x; ++b) sum += *(const volatile int*)(slots + b);
    *total = sum;
  }
}

// The block's number through a __shared__ variable of a function template, with an atomic by
// every thread (a point where interleaved blocks switch) between the store and the load.
template <int N>
int through_template_shared(int* counter) {
  __shared__ int number[N];
  if (threadIdx.x == 0) number[0] = int(blockIdx.x);
  __syncthreads();
  atomicAdd(counter, 1);
  __syncthreads();
  return number[0];
}

void shared_per_block(int* counter, int* out) {
  const int number = through_template_shared<1>(counter);
  if (threadIdx.x == 0) out[blockIdx.x] = number;
}

// Block b > 0 waits until block b - 1 has raised its flag, then raises its own.
void chain_of_flags(int* flags, bool never) {
  if (threadIdx.x == 0) {
    if (blockIdx.x > 0 || never)
      while (*(const volatile int*)(flags + (blockIdx.x > 0 ? blockIdx.x - 1 : gridDim.x - 1)) == 0)
        ::tutel::emulation::wait_for_other_blocks("chain_of_flags: the previous block has not raised its flag");
    __threadfence();
    atomicExch(flags + blockIdx.x, 1);
  }
}

namespace {

using tutel::emulation::EmulationError;
using tutel::emulation::GridSchedule;
using tutel::emulation::LaunchOptions;
using tutel::emulation::MemoryRegion;
using tutel::emulation::Schedule;

constexpr unsigned kBlocks = 7;
const GridSchedule kGrids[] = {GridSchedule::kSequential, GridSchedule::kSequentialDelayed,
                               GridSchedule::kInterleaved, GridSchedule::kInterleavedDelayed};

LaunchOptions options_for(GridSchedule grid, uint64_t seed) {
  LaunchOptions options;
  options.schedule = seed % 2 ? Schedule::kShuffled : Schedule::kRunAhead;
  options.seed = seed;
  options.grid = grid;
  options.resident_blocks = 3;
  return options;
}

// The sum publish_then_count finds, with `slots` and `total` weak memory if asked.
int publish_then_count_total(GridSchedule grid, uint64_t seed, bool fence, bool weak) {
  std::vector<int> values(kBlocks), slots(kBlocks, 0), count(1, 0), total(1, -1);
  std::iota(values.begin(), values.end(), 1);
  LaunchOptions options = options_for(grid, seed);
  if (weak) options.weak_memory = {MemoryRegion{slots.data(), sizeof(int) * kBlocks}, MemoryRegion{total.data(), 4}};
  tutel::emulation::launch("publish_then_count", kBlocks, 1, TUTEL_BLOCK_THREADS,
                           [&] { publish_then_count(values.data(), slots.data(), count.data(), total.data(), fence); },
                           options);
  return total[0];
}

const int kSum = int(kBlocks * (kBlocks + 1) / 2);

TEST(Emulation, AFencedHandoffIsRightUnderEveryGridScheduleAndWeakMemory) {
  for (GridSchedule grid : kGrids)
    for (uint64_t seed = 0; seed < 8; ++seed) {
      EXPECT_EQ(publish_then_count_total(grid, seed, true, true), kSum) << int(grid) << " " << seed;
      EXPECT_EQ(publish_then_count_total(grid, seed, true, false), kSum) << int(grid) << " " << seed;
    }
}

TEST(Emulation, WeakMemoryGivesStaleDataWhereTheFenceIsMissing) {
  for (GridSchedule grid : kGrids)
    for (uint64_t seed = 0; seed < 8; ++seed) {
      // The last block sees only its own value: the others' are not published before they count.
      EXPECT_LT(publish_then_count_total(grid, seed, false, true), kSum) << int(grid) << " " << seed;
      // Sequentially consistent memory does not show the missing fence.
      EXPECT_EQ(publish_then_count_total(grid, seed, false, false), kSum) << int(grid) << " " << seed;
    }
}

TEST(Emulation, InterleavedBlocksKeepTheirOwnSharedMemory) {
  for (GridSchedule grid : kGrids)
    for (uint64_t seed = 0; seed < 4; ++seed) {
      std::vector<int> counter(1, 0), out(kBlocks, -1);
      tutel::emulation::launch("shared_per_block", kBlocks, 1, TUTEL_BLOCK_THREADS,
                               [&] { shared_per_block(counter.data(), out.data()); }, options_for(grid, seed));
      for (unsigned b = 0; b < kBlocks; ++b) EXPECT_EQ(out[b], int(b)) << int(grid) << " " << seed;
    }
}

TEST(Emulation, SpinWaitsLetOtherBlocksRunWhenInterleaved) {
  for (GridSchedule grid : {GridSchedule::kInterleaved, GridSchedule::kInterleavedDelayed})
    for (uint64_t seed = 0; seed < 4; ++seed) {
      std::vector<int> flags(kBlocks, 0);
      LaunchOptions options = options_for(grid, seed);
      options.schedule = Schedule::kAscending;  // the blocks start in order: each waits for a started one
      tutel::emulation::launch("chain_of_flags", kBlocks, 1, TUTEL_BLOCK_THREADS,
                               [&] { chain_of_flags(flags.data(), false); }, options);
      EXPECT_EQ(std::accumulate(flags.begin(), flags.end(), 0), int(kBlocks));
    }
}

TEST(Emulation, ASpinWaitFailsWhereBlocksRunOneAfterAnother) {
  std::vector<int> flags(kBlocks, 0);
  LaunchOptions options = options_for(GridSchedule::kSequential, 0);
  options.schedule = Schedule::kDescending;  // block 6 first: it waits for block 5, which has not run
  try {
    tutel::emulation::launch("chain_of_flags", kBlocks, 1, TUTEL_BLOCK_THREADS,
                             [&] { chain_of_flags(flags.data(), false); }, options);
    FAIL() << "the launch passed";
  } catch (const EmulationError& error) {
    EXPECT_NE(std::string(error.what()).find("the previous block has not raised its flag"), std::string::npos)
        << error.what();
  }
}

TEST(Emulation, BlocksWaitingForOneAnotherForEverFailTheLaunch) {
  std::vector<int> flags(kBlocks, 0);
  try {
    tutel::emulation::launch("chain_of_flags", kBlocks, 1, TUTEL_BLOCK_THREADS,
                             [&] { chain_of_flags(flags.data(), true); }, options_for(GridSchedule::kInterleaved, 1));
    FAIL() << "the launch passed";
  } catch (const EmulationError& error) {
    EXPECT_NE(std::string(error.what()).find("wait for one another"), std::string::npos) << error.what();
  }
}

}  // namespace
