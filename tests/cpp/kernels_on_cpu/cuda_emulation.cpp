// The scheduler behind cuda_emulation.h: a block's threads as fibers on the
// calling thread, barriers and warp operations as meeting points.
#include "cuda_emulation.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

#include "../../../kernels/kernel_abi.h"

#if defined(__SANITIZE_ADDRESS__)
#define TUTEL_EMULATION_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TUTEL_EMULATION_ASAN 1
#endif
#endif
#ifdef TUTEL_EMULATION_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// The __shared__ section's bounds (absent when a kernel file has no __shared__ variable).
extern "C" char __start_tutel_emulated_shared[] __attribute__((weak));
extern "C" char __stop_tutel_emulated_shared[] __attribute__((weak));

namespace tutel {
namespace emulation {
namespace detail {

thread_local const ThreadCoordinates* current = nullptr;

namespace {

// --------------------------------------------------- context switching --
// On x86-64 a switch saves the callee-saved registers and the floating-point
// control words on the old stack and restores them from the new one: a few
// nanoseconds, where swapcontext also makes a system call (signal mask).
// Elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void tutel_emulation_switch(void** save_sp, void* resume_sp);
asm(R"(
  .text
  .globl tutel_emulation_switch
  .type tutel_emulation_switch, @function
tutel_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tutel_emulation_switch, .-tutel_emulation_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

struct Context {
  void* sp = nullptr;
};

void switch_context(Context& save, Context& resume) { tutel_emulation_switch(&save.sp, resume.sp); }

// A context that starts running entry() on the stack [stack, stack + size).
void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  uint64_t* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15));
  *--top = 0;                                    // entry's return address: it never returns
  *--top = reinterpret_cast<uint64_t>(entry);    // where the first switch's `ret` goes
  for (int r = 0; r < 6; ++r) *--top = 0;        // rbp, rbx, r12-r15
  uint32_t control[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
  control[1] &= 0xffffu;
  --top;
  std::memcpy(top, control, sizeof(control));
  c.sp = top;
}
#else
struct Context {
  ucontext_t context;
};

void switch_context(Context& save, Context& resume) { swapcontext(&save.context, &resume.context); }

void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.context);
  c.context.uc_stack.ss_sp = stack;
  c.context.uc_stack.ss_size = size;
  c.context.uc_link = nullptr;
  makecontext(&c.context, entry, 0);
}
#endif

// Static shared memory a block may use on every GPU tutel supports.
constexpr size_t kMaxSharedBytes = 48 * 1024;
constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;  // ample for the kernels, with AddressSanitizer's redzones too

enum class State { kReady, kAtBarrier, kInWarpOp, kExited };

struct Fiber {
  Context context;
  char* stack = nullptr;  // kStackBytes above a guard page
  ThreadCoordinates coordinates;
  State state = State::kReady;
  // The posted warp operation while state == kInWarpOp.
  Site site{nullptr, 0, nullptr};
  WarpOp op = WarpOp::kSyncwarp;
  unsigned mask = 0;
  uint64_t value = 0;
  int argument = 0;
  int width = 32;
  uint64_t result = 0;
  void* fake_stack = nullptr;  // AddressSanitizer's, while switched out
};

// One launch in progress on this thread.
struct Launch {
  const char* kernel = nullptr;
  const std::function<void()>* body = nullptr;
  LaunchOptions options;
  std::mt19937_64 rng;
  std::vector<Fiber>* fibers = nullptr;
  unsigned threads = 0;
  std::deque<unsigned> ready;
  unsigned at_barrier = 0;
  unsigned exited = 0;
  Site barrier_site{nullptr, 0, nullptr};
  Fiber* running = nullptr;
  Context scheduler;
  const void* scheduler_stack = nullptr;  // for AddressSanitizer
  size_t scheduler_stack_size = 0;
  std::string error;  // set when the launch must stop
};

thread_local Launch* g_launch = nullptr;

// Fiber stacks, made once per thread and reused by every block.
std::vector<Fiber>& fiber_pool(unsigned threads) {
  thread_local std::vector<Fiber> pool;
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  while (pool.size() < threads) {
    pool.emplace_back();
    void* memory = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) throw std::runtime_error("kernels on CPU: cannot map a fiber stack");
    mprotect(memory, page, PROT_NONE);  // a stack overflow faults instead of corrupting memory
    pool.back().stack = static_cast<char*>(memory) + page;
  }
  return pool;
}

std::string describe(const Site& site) {
  std::ostringstream out;
  out << site.what << " at " << site.file << ":" << site.line;
  return out.str();
}

std::string thread_name(const Fiber& f) {
  std::ostringstream out;
  out << "block (" << f.coordinates.block_idx.x << ", " << f.coordinates.block_idx.y << ") thread "
      << f.coordinates.thread_idx.x << " (warp " << f.coordinates.thread_idx.x / kWarp << " lane "
      << f.coordinates.thread_idx.x % kWarp << ")";
  return out.str();
}

// Switches from the running fiber back to the scheduler; returns when resumed.
void switch_to_scheduler(bool finished) {
  Launch& l = *g_launch;
  Fiber* self = l.running;
#ifdef TUTEL_EMULATION_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &self->fake_stack, l.scheduler_stack,
                                 l.scheduler_stack_size);
#else
  (void)finished;
#endif
  switch_context(self->context, l.scheduler);
#ifdef TUTEL_EMULATION_ASAN
  __sanitizer_finish_switch_fiber(self->fake_stack, nullptr, nullptr);
#endif
}

// Stops the launch: the scheduler throws `message`; this fiber never resumes.
[[noreturn]] void fail(const std::string& message) {
  Launch& l = *g_launch;
  if (l.error.empty())
    l.error = std::string("kernels on CPU: ") + l.kernel + ", " + thread_name(*l.running) + ": " + message;
  switch_to_scheduler(true);
  __builtin_unreachable();
}

void fiber_entry() {
  Launch& l = *g_launch;
#ifdef TUTEL_EMULATION_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &l.scheduler_stack, &l.scheduler_stack_size);
#endif
  (*l.body)();
  Fiber& self = *l.running;
  // Lanes waiting for this one at a warp operation or threads at a barrier would wait forever.
  const unsigned warp_base = self.coordinates.thread_idx.x & ~unsigned(kWarp - 1);
  const unsigned lane_bit = 1u << (self.coordinates.thread_idx.x % kWarp);
  for (unsigned t = warp_base; t < std::min(warp_base + kWarp, l.threads); ++t) {
    const Fiber& other = (*l.fibers)[t];
    if (other.state == State::kInWarpOp && (other.mask & lane_bit))
      fail("exited while " + thread_name(other) + " waits for it in " + describe(other.site) +
           " (a warp operation with an inactive lane)");
  }
  if (l.at_barrier > 0)
    fail("exited while " + std::to_string(l.at_barrier) + " threads wait at " + describe(l.barrier_site) +
         " (divergent __syncthreads)");
  self.state = State::kExited;
  ++l.exited;
  switch_to_scheduler(true);
}

void make_ready(Launch& l, unsigned t) {
  (*l.fibers)[t].state = State::kReady;
  if (l.options.schedule == Schedule::kRunAhead)
    l.ready.push_front(t);
  else
    l.ready.push_back(t);
}

// Thread order of a block, and order of the blocks of a grid.
std::vector<unsigned> ordering(Launch& l, unsigned n) {
  std::vector<unsigned> order(n);
  std::iota(order.begin(), order.end(), 0u);
  if (l.options.schedule == Schedule::kDescending) std::reverse(order.begin(), order.end());
  if (l.options.schedule == Schedule::kShuffled) std::shuffle(order.begin(), order.end(), l.rng);
  return order;
}

void run_block(Launch& l, uint3 block, dim3 grid) {
  std::vector<Fiber>& fibers = *l.fibers;
  if (__start_tutel_emulated_shared != nullptr)
    std::memset(__start_tutel_emulated_shared, 0xff, size_t(__stop_tutel_emulated_shared - __start_tutel_emulated_shared));
  l.ready.clear();
  l.at_barrier = 0;
  l.exited = 0;
  for (unsigned t : ordering(l, l.threads)) {
    Fiber& f = fibers[t];
    f.coordinates = ThreadCoordinates{uint3{t, 0, 0}, block, dim3{l.threads, 1, 1}, grid};
    f.state = State::kReady;
    f.fake_stack = nullptr;
#ifdef TUTEL_EMULATION_ASAN
    // The previous block's fibers never returned: their frames' redzones are still poisoned.
    __asan_unpoison_memory_region(f.stack, kStackBytes);
#endif
    make_context(f.context, f.stack, kStackBytes, &fiber_entry);
    l.ready.push_back(t);
  }
  while (l.exited < l.threads) {
    if (l.ready.empty()) {
      std::ostringstream out;
      out << "kernels on CPU: " << l.kernel << ": deadlock in block (" << block.x << ", " << block.y << "):";
      for (const Fiber& f : fibers)
        if (f.state == State::kInWarpOp) out << "\n  " << thread_name(f) << " waits in " << describe(f.site);
      if (l.at_barrier > 0) out << "\n  " << l.at_barrier << " threads wait at " << describe(l.barrier_site);
      throw EmulationError(out.str());
    }
    const unsigned t = l.ready.front();
    l.ready.pop_front();
    Fiber& f = fibers[t];
    l.running = &f;
    current = &f.coordinates;
    void* fake_stack = nullptr;
#ifdef TUTEL_EMULATION_ASAN
    __sanitizer_start_switch_fiber(&fake_stack, f.stack, kStackBytes);
#endif
    switch_context(l.scheduler, f.context);
#ifdef TUTEL_EMULATION_ASAN
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
    (void)fake_stack;
    current = nullptr;
    if (!l.error.empty()) throw EmulationError(l.error);
  }
}

// The result of `op` for `lane` once every lane of the mask has posted.
uint64_t warp_result(const Fiber* warp, unsigned lane) {
  const Fiber& self = warp[lane];
  const unsigned mask = self.mask;
  const int width = self.width;
  const unsigned segment = lane & ~unsigned(width - 1);
  int source = int(lane);
  switch (self.op) {
    case WarpOp::kSyncwarp: return 0;
    case WarpOp::kBallot: {
      uint64_t bits = 0;
      for (unsigned i = 0; i < kWarp; ++i)
        if ((mask >> i & 1u) && warp[i].value) bits |= uint64_t(1) << i;
      return bits;
    }
    case WarpOp::kMatchAny: {
      uint64_t bits = 0;
      for (unsigned i = 0; i < kWarp; ++i)
        if ((mask >> i & 1u) && warp[i].value == self.value) bits |= uint64_t(1) << i;
      return bits;
    }
    case WarpOp::kShflIndex: source = int(segment) + (self.argument & (width - 1)); break;
    case WarpOp::kShflUp:
      source = int(lane) - self.argument;
      if (source < int(segment)) return self.value;  // CUDA: the lane keeps its own value
      break;
    case WarpOp::kShflDown:
      source = int(lane) + self.argument;
      if (source >= int(segment) + width) return self.value;
      break;
    case WarpOp::kShflXor:
      source = int(lane ^ unsigned(self.argument));
      if (source < int(segment) || source >= int(segment) + width)
        throw std::string("__shfl_xor_sync reads lane ") + std::to_string(source) +
            " outside the lane's width segment (not modelled)";
      break;
  }
  if (!(mask >> source & 1u))
    throw std::string("reads lane ") + std::to_string(source) + ", which is not in the mask";
  return warp[source].value;
}

}  // namespace

void syncthreads(Site site) {
  Launch& l = *g_launch;
  Fiber& self = *l.running;
  if (l.exited > 0)
    fail("reached " + describe(site) + " after " + std::to_string(l.exited) +
         " threads of the block exited (divergent __syncthreads)");
  if (l.at_barrier > 0 && (l.barrier_site.line != site.line || std::strcmp(l.barrier_site.file, site.file) != 0))
    fail("reached " + describe(site) + " while other threads wait at " + describe(l.barrier_site) +
         " (divergent __syncthreads)");
  const unsigned warp_base = self.coordinates.thread_idx.x & ~unsigned(kWarp - 1);
  const unsigned lane_bit = 1u << (self.coordinates.thread_idx.x % kWarp);
  for (unsigned t = warp_base; t < std::min(warp_base + kWarp, l.threads); ++t) {
    const Fiber& other = (*l.fibers)[t];
    if (other.state == State::kInWarpOp && (other.mask & lane_bit))
      fail("reached " + describe(site) + " while " + thread_name(other) + " waits for it in " +
           describe(other.site));
  }
  l.barrier_site = site;
  self.state = State::kAtBarrier;
  if (++l.at_barrier < l.threads) {
    switch_to_scheduler(false);
    return;
  }
  // The last thread: release everyone in the schedule's order, this one included.
  l.at_barrier = 0;
  for (unsigned t : ordering(l, l.threads)) make_ready(l, t);
  switch_to_scheduler(false);
}

uint64_t warp_op(Site site, WarpOp op, unsigned mask, uint64_t value, int argument, int width) {
  Launch& l = *g_launch;
  Fiber& self = *l.running;
  const unsigned lane = self.coordinates.thread_idx.x % kWarp;
  const unsigned warp_base = self.coordinates.thread_idx.x - lane;
  Fiber* warp = &(*l.fibers)[warp_base];
  const unsigned lanes = std::min<unsigned>(kWarp, l.threads - warp_base);
  if (!(mask >> lane & 1u)) fail(describe(site) + " with a mask that leaves out the calling lane");
  if (width < 1 || width > kWarp || (width & (width - 1)) != 0)
    fail(describe(site) + " with width " + std::to_string(width) + " (not a power of two up to 32)");
  self.site = site;
  self.op = op;
  self.mask = mask;
  self.value = value;
  self.argument = argument;
  self.width = width;
  self.state = State::kInWarpOp;
  bool complete = true;
  for (unsigned i = 0; i < kWarp; ++i) {
    if (!(mask >> i & 1u)) continue;
    if (i >= lanes) fail(describe(site) + " names lane " + std::to_string(i) + ", which the block does not have");
    const Fiber& other = warp[i];
    switch (other.state) {
      case State::kExited:
        fail(describe(site) + " names lane " + std::to_string(i) + ", which has exited (inactive lane)");
      case State::kAtBarrier:
        fail(describe(site) + " names lane " + std::to_string(i) + ", which waits at " +
             describe(l.barrier_site));
      case State::kInWarpOp: {
        // A lane busy in another warp operation (another group of lanes, say)
        // may come here next; if it never can, the scheduler finds a deadlock.
        const bool same_site = other.site.line == site.line && std::strcmp(other.site.file, site.file) == 0;
        if (!same_site || other.op != op) {
          complete = false;
        } else if (other.mask != mask) {
          fail(describe(site) + " with mask " + std::to_string(mask) + " while lane " + std::to_string(i) +
               " waits there with mask " + std::to_string(other.mask));
        }
        break;
      }
      case State::kReady: complete = false; break;
    }
  }
  if (complete) {
    std::vector<uint64_t> results(kWarp);
    for (unsigned i = 0; i < kWarp; ++i) {
      if (!(mask >> i & 1u)) continue;
      try {
        results[i] = warp_result(warp, i);
      } catch (const std::string& problem) {
        fail(describe(site) + ": lane " + std::to_string(i) + " " + problem);
      }
    }
    for (unsigned i = 0; i < kWarp; ++i) {
      if (!(mask >> i & 1u)) continue;
      warp[i].result = results[i];
      if (i != lane) make_ready(l, warp_base + i);
    }
    self.state = State::kReady;
    // The shuffled schedule lets others run first; the others continue at once.
    if (l.options.schedule == Schedule::kShuffled) {
      l.ready.push_back(warp_base + lane);
      switch_to_scheduler(false);
    }
    return self.result;
  }
  switch_to_scheduler(false);
  return self.result;
}

void atomic_done() {
  Launch& l = *g_launch;
  if (l.options.schedule != Schedule::kShuffled) return;
  l.ready.push_back(unsigned(l.running->coordinates.thread_idx.x));
  switch_to_scheduler(false);
}

}  // namespace detail

void launch(const char* kernel, unsigned grid_x, unsigned grid_y, unsigned block_threads,
            const std::function<void()>& thread_body, const LaunchOptions& options) {
  using namespace detail;
  if (g_launch != nullptr) throw EmulationError("kernels on CPU: a launch from inside a kernel");
  if (block_threads != TUTEL_BLOCK_THREADS)
    throw EmulationError(std::string("kernels on CPU: ") + kernel + " launched with " +
                         std::to_string(block_threads) + " threads per block, not TUTEL_BLOCK_THREADS");
  const size_t shared = __start_tutel_emulated_shared == nullptr
                            ? 0 : size_t(__stop_tutel_emulated_shared - __start_tutel_emulated_shared);
  if (shared > kMaxSharedBytes)
    throw EmulationError(std::string("kernels on CPU: ") + kernel + ": the kernel file's __shared__ variables take " +
                         std::to_string(shared) + " bytes, more than the 48 KiB a block may have");
  Launch l;
  l.kernel = kernel;
  l.body = &thread_body;
  l.options = options;
  l.rng.seed(options.seed);
  l.threads = block_threads;
  l.fibers = &fiber_pool(block_threads);
  struct Reset {
    ~Reset() { g_launch = nullptr; current = nullptr; }
  } reset;
  g_launch = &l;
  const dim3 grid{grid_x, grid_y, 1};
  std::vector<unsigned> blocks = ordering(l, grid_x * grid_y);
  for (unsigned b : blocks) run_block(l, uint3{b % grid_x, b / grid_x, 0}, grid);
}

}  // namespace emulation
}  // namespace tutel
