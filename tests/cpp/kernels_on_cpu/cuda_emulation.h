// The CUDA built-ins that tutel's kernels use, for compiling kernels/*.cu with
// the host compiler and running them on the CPU (tests/cpp/kernels_on_cpu).
//
// Include this header, then the .cu file, with the variant's -D option set
// (and TUTEL_HOST_EMULATION, which makes kernels/tutel_device.cuh take its
// float16 conversions from here instead of PTX).  A kernel is then a plain C++
// function; tutel::emulation::launch runs one grid of it.
//
// Execution model:
// * The blocks of a grid run as the grid schedule says (LaunchOptions::grid):
//   one after another (in the order the thread schedule gives them: ascending,
//   descending, shuffled; run-ahead takes ascending), optionally with one block
//   moved behind all others; or interleaved, up to `resident_blocks` blocks in
//   progress at once, switching between them at barriers, fences, atomics and
//   spin waits (the next block chosen at random from the seed), optionally with
//   one block starved after its first fence or atomic until no other block can
//   move on.  Each block keeps its own __shared__ memory.
// * Each block's threads are fibers with stacks of their own on the calling
//   thread (switched by a few instructions on x86-64, by ucontext elsewhere),
//   scheduled cooperatively: a thread runs until it waits at __syncthreads, at a
//   warp operation, or exits (and, under the interleaved grid schedules, after a
//   fence, an atomic or a spin wait).  So barriers and warp operations have
//   CUDA's semantics (independent thread scheduling: lanes of a warp meet only
//   at *_sync operations), and the interleaving between them is set by the
//   schedule; the shuffled schedule also switches threads after every atomic.
// * __shared__ variables are statics in their own section (those of function
//   templates, which GCC keeps out of the section, are found in the symbol
//   table); they are filled with 0xff bytes before every block (shared memory
//   starts undefined on a GPU; ints read as -1 and floats as NaN), saved and
//   restored when blocks are interleaved, and a file whose (non-template)
//   __shared__ variables exceed 48 KiB is refused.
// * Global memory is sequentially consistent, except in the regions named by
//   LaunchOptions::weak_memory, whose ordering is a GPU's as far as a missing
//   release fence goes: a thread's plain stores there stay private to its block
//   until the thread (or, for stores made before a barrier the thread passed,
//   any thread of the block) executes __threadfence, or the kernel ends.  Other
//   blocks read the last published bytes meanwhile, so a block that signals
//   with an atomic before fencing hands stale data to the block that acts on
//   the signal.  Atomics act on published memory and publish their result at
//   once.  Stores are found by comparing the regions with a copy at fences,
//   atomics, barriers and block switches, so keep the regions small.  Acquire
//   fences are not modelled (a reader always sees published bytes).
// * Spin loops call wait_for_other_blocks; where blocks run one after another
//   that fails the launch (the blocks waited for have not run), and the
//   interleaved schedules run other blocks meanwhile, failing the launch when
//   every block in progress waits.
// * A missing __syncwarp that a later *_sync operation makes harmless on the
//   CPU may still race on a GPU.
//
// Anything not modelled fails the launch with tutel::emulation::EmulationError
// naming the kernel, block, thread and source line, rather than passing:
// __syncthreads reached while other threads of the block have exited or wait
// at another __syncthreads; a warp operation whose mask names a lane that has
// exited or waits at a barrier, or leaves out the calling lane; lanes at one
// warp operation with different masks; a shuffle reading a lane outside the
// mask or its width segment; a width that is not a power of two up to 32; a
// deadlock (such as lanes waiting for each other at different warp
// operations); too much shared memory; a block size other than
// TUTEL_BLOCK_THREADS.
// Inline PTX, dynamic shared memory and other built-ins do not compile.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

// ---------------------------------------------------------- vector types --
struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct alignas(16) longlong2 { long long x, y; };

namespace tutel {
namespace emulation {

// A launch that relied on something the emulation does not model, or broke a rule of CUDA's.
class EmulationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The order in which a block's ready threads run (and, run one after
// another, the blocks of a grid).  Released threads queue behind the others,
// except with kRunAhead: there the threads a warp operation or barrier
// releases run first, so one warp may finish before the next one starts (as it
// may on a GPU).
enum class Schedule { kAscending, kDescending, kShuffled, kRunAhead };

// How the blocks of a grid run (see the execution model above).  The delayed
// block of the *Delayed schedules is block number seed % blocks (row-major).
enum class GridSchedule { kSequential, kSequentialDelayed, kInterleaved, kInterleavedDelayed };

// A range of global memory.
struct MemoryRegion {
  const void* base;
  size_t bytes;
};

struct LaunchOptions {
  Schedule schedule = Schedule::kAscending;
  uint64_t seed = 0;  // for kShuffled and the grid schedules' choices
  GridSchedule grid = GridSchedule::kSequential;
  unsigned resident_blocks = 4;  // blocks in progress at once when interleaved
  std::vector<MemoryRegion> weak_memory;  // global memory ordered as on a GPU (see above)
};

// Runs `thread_body` once per thread of a grid_x x grid_y grid of blocks of
// block_threads threads (the kernel call with its arguments); throws
// EmulationError if the kernel breaks a rule (see above).
void launch(const char* kernel, unsigned grid_x, unsigned grid_y, unsigned block_threads,
            const std::function<void()>& thread_body, const LaunchOptions& options = {});

// Where in the kernel source a synchronising built-in was called.
struct Site {
  const char* file;
  int line;
  const char* what;
};

// ------------------------------------------------------------- internals --
namespace detail {

struct ThreadCoordinates {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
// The running thread's coordinates (set by the scheduler at every switch).
extern thread_local const ThreadCoordinates* current;

enum class WarpOp { kSyncwarp, kShflIndex, kShflUp, kShflDown, kShflXor, kBallot, kMatchAny };

void syncthreads(Site site);
// Posts this lane's part of a warp operation and returns its result once every
// lane of `mask` has posted (see cuda_emulation.cpp for each op).
uint64_t warp_op(Site site, WarpOp op, unsigned mask, uint64_t value, int argument, int width);
// Around an atomic read-modify-write of `bytes` at `address`: publishes the
// block's pending stores there first and the result after (weak memory), and
// is a point where the shuffled and interleaved schedules switch threads.
void atomic_begin(const void* address, size_t bytes);
void atomic_done(const void* address, size_t bytes);
// __threadfence: publishes the thread's stores (weak memory); a switch point
// of the interleaved schedules.
void fence();

template <class T>
uint64_t to_bits(T value) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "warp operations move up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}
template <class T>
T from_bits(uint64_t bits) {
  T value;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

template <class T>
T shuffle(Site site, WarpOp op, unsigned mask, T value, int argument, int width) {
  return from_bits<T>(warp_op(site, op, mask, to_bits(value), argument, width));
}

}  // namespace detail

// A kernel's spin loop (under TUTEL_HOST_EMULATION) calls this each time what
// it waits for is not there yet: the interleaved grid schedules run other
// blocks meanwhile; where blocks run one after another the launch fails with
// `why` (the blocks it waits for have not run, or will not run before it ends).
void wait_for_other_blocks(const char* why);

}  // namespace emulation
}  // namespace tutel

// ------------------------------------------------------------- built-ins --
#define TUTEL_EMULATION_SITE(what) (::tutel::emulation::Site{__FILE__, __LINE__, what})

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
// Per-block shared memory: see the header comment.
#define __shared__ static __attribute__((section("tutel_emulated_shared")))

#define threadIdx (::tutel::emulation::detail::current->thread_idx)
#define blockIdx (::tutel::emulation::detail::current->block_idx)
#define blockDim (::tutel::emulation::detail::current->block_dim)
#define gridDim (::tutel::emulation::detail::current->grid_dim)
constexpr int warpSize = 32;

#define __syncthreads() ::tutel::emulation::detail::syncthreads(TUTEL_EMULATION_SITE("__syncthreads"))
#define __syncwarp(...) ::tutel::emulation::emulated_syncwarp(TUTEL_EMULATION_SITE("__syncwarp"), ##__VA_ARGS__)
#define __shfl_sync(...) ::tutel::emulation::emulated_shfl(TUTEL_EMULATION_SITE("__shfl_sync"), ::tutel::emulation::detail::WarpOp::kShflIndex, __VA_ARGS__)
#define __shfl_up_sync(...) ::tutel::emulation::emulated_shfl(TUTEL_EMULATION_SITE("__shfl_up_sync"), ::tutel::emulation::detail::WarpOp::kShflUp, __VA_ARGS__)
#define __shfl_down_sync(...) ::tutel::emulation::emulated_shfl(TUTEL_EMULATION_SITE("__shfl_down_sync"), ::tutel::emulation::detail::WarpOp::kShflDown, __VA_ARGS__)
#define __shfl_xor_sync(...) ::tutel::emulation::emulated_shfl(TUTEL_EMULATION_SITE("__shfl_xor_sync"), ::tutel::emulation::detail::WarpOp::kShflXor, __VA_ARGS__)
#define __ballot_sync(mask, predicate) ::tutel::emulation::emulated_ballot(TUTEL_EMULATION_SITE("__ballot_sync"), mask, predicate)
#define __match_any_sync(mask, value) ::tutel::emulation::emulated_match_any(TUTEL_EMULATION_SITE("__match_any_sync"), mask, value)

namespace tutel {
namespace emulation {

inline void emulated_syncwarp(Site site, unsigned mask = 0xffffffffu) {
  detail::warp_op(site, detail::WarpOp::kSyncwarp, mask, 0, 0, 32);
}

template <class T>
T emulated_shfl(Site site, detail::WarpOp op, unsigned mask, T value, int argument, int width = 32) {
  return detail::shuffle(site, op, mask, value, argument, width);
}

inline unsigned emulated_ballot(Site site, unsigned mask, int predicate) {
  return unsigned(detail::warp_op(site, detail::WarpOp::kBallot, mask, predicate != 0, 0, 32));
}

template <class T>
unsigned emulated_match_any(Site site, unsigned mask, T value) {
  static_assert(std::is_integral<T>::value, "__match_any_sync takes an integer");
  return unsigned(detail::warp_op(site, detail::WarpOp::kMatchAny, mask, detail::to_bits(value), 0, 32));
}

}  // namespace emulation
}  // namespace tutel

// Atomics return the old value; one runs at a time, on published memory
// (weak memory), then the shuffled and interleaved schedules may switch threads.
#define TUTEL_EMULATED_ATOMIC(address, update)                                  \
  ::tutel::emulation::detail::atomic_begin(address, sizeof(*address));          \
  const T old = *address;                                                        \
  update;                                                                        \
  ::tutel::emulation::detail::atomic_done(address, sizeof(*address));           \
  return old
template <class T>
T atomicAdd(T* address, T value) {
  TUTEL_EMULATED_ATOMIC(address, *address = old + value);
}
template <class T>
T atomicMax(T* address, T value) {
  TUTEL_EMULATED_ATOMIC(address, if (value > old) *address = value);
}
template <class T>
T atomicMin(T* address, T value) {
  TUTEL_EMULATED_ATOMIC(address, if (value < old) *address = value);
}
template <class T>
T atomicCAS(T* address, T compare, T value) {
  TUTEL_EMULATED_ATOMIC(address, if (old == compare) *address = value);
}
template <class T>
T atomicExch(T* address, T value) {
  TUTEL_EMULATED_ATOMIC(address, *address = value);
}
#undef TUTEL_EMULATED_ATOMIC

// Fences order global memory at the device's scope (see weak memory above);
// the block scope needs nothing here (a block's threads share one view).
inline void __threadfence() { ::tutel::emulation::detail::fence(); }
inline void __threadfence_block() {}
inline void __threadfence_system() { ::tutel::emulation::detail::fence(); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }

inline float __uint_as_float(unsigned x) { return ::tutel::emulation::detail::from_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return unsigned(::tutel::emulation::detail::to_bits(x)); }
inline float __int_as_float(int x) { return __uint_as_float(unsigned(x)); }
inline int __float_as_int(float x) { return int(__float_as_uint(x)); }
inline long long __double_as_longlong(double x) { return (long long)::tutel::emulation::detail::to_bits(x); }
inline double __longlong_as_double(long long x) {
  return ::tutel::emulation::detail::from_bits<double>((uint64_t)x);
}

// What cvt.f32.f16 and cvt.rn.f16.f32 do, through the compiler's IEEE binary16
// type (exact widening; round to nearest even, overflow to infinity, gradual
// underflow), independent of csrc/core's conversions.  NaN payloads are not
// modelled.
inline float emulated_cvt_f32_f16(unsigned short bits) {
  _Float16 half;
  std::memcpy(&half, &bits, sizeof(half));
  return float(half);
}
inline unsigned short emulated_cvt_rn_f16_f32(float value) {
  const _Float16 half = _Float16(value);
  unsigned short bits;
  std::memcpy(&bits, &half, sizeof(bits));
  return bits;
}
