// The scheduler behind cuda_emulation.h: a block's threads as fibers on the
// calling thread, barriers and warp operations as meeting points; the grid's
// blocks one after another or interleaved; weak global memory where asked.
#include "cuda_emulation.h"

#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <unordered_map>
#include <utility>
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
// Spin waits in a row, with no thread doing anything else in between, after
// which the blocks in progress are taken to wait for one another for ever.
constexpr unsigned kSpinsWithoutProgress = 20000;

enum class State { kReady, kAtBarrier, kInWarpOp, kExited };

struct Fiber {
  Context context;
  char* stack = nullptr;  // kStackBytes above a guard page
  ThreadCoordinates coordinates;
  State state = State::kReady;
  bool spinning = false;  // came back from wait_for_other_blocks
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

// Why the fiber that ran last came back to the scheduler: it waits for
// threads of its block (barrier, warp operation), passed a point other blocks
// may observe (fence, atomic, completed barrier), spins, or exited.
enum class Yield { kWaits, kEvent, kSpin, kExit };

// A store to weak memory that other blocks do not see yet: the byte, the
// thread that made it, the block's count of completed barriers then, and its
// place among all stores of the launch.
struct Pending {
  unsigned char value;
  unsigned thread;
  uint64_t epoch;
  uint64_t sequence;
};

// A block in progress (one slot of the resident blocks).
struct Block {
  bool active = false;
  uint3 index{0, 0, 0};
  Fiber* fibers = nullptr;   // this slot's threads, from the fiber pool
  std::vector<char> shared;  // its __shared__ section while another block's is in place
  std::deque<unsigned> ready;
  unsigned at_barrier = 0;
  unsigned exited = 0;
  Site barrier_site{nullptr, 0, nullptr};
  bool delayed = false;  // the block a *Delayed grid schedule holds back
  bool held = false;     // delayed, and past its first fence or atomic
  uint64_t epoch = 0;    // barriers completed
  std::unordered_map<size_t, Pending> pending;  // weak memory: flat byte number -> unpublished store
};

// A weak-memory region: the bytes other blocks see (published) and the bytes
// memory held when it was last compared (seen).
struct WeakRegion {
  unsigned char* base;
  size_t bytes;
  size_t first;  // flat number of its first byte
  std::vector<unsigned char> published, seen;
};

// One launch in progress on this thread.
struct Launch {
  const char* kernel = nullptr;
  const std::function<void()>* body = nullptr;
  LaunchOptions options;
  std::mt19937_64 rng;
  unsigned threads = 0;
  bool interleaved = false;
  std::vector<Block> slots;
  Block* block = nullptr;  // whose __shared__ section and weak-memory view are in place
  Fiber* running = nullptr;
  Yield yield = Yield::kWaits;
  std::vector<WeakRegion> weak;
  uint64_t sequence = 0;
  std::vector<std::pair<size_t, Pending>> retired;  // unpublished stores of finished blocks
  Context scheduler;
  const void* scheduler_stack = nullptr;  // for AddressSanitizer
  size_t scheduler_stack_size = 0;
  std::string error;  // set when the launch must stop
};

thread_local Launch* g_launch = nullptr;

// ------------------------------------------------------- shared memory --
// A block's __shared__ memory: the tutel_emulated_shared section, plus the
// __shared__ variables of function templates (block_sum<A>, decode's
// down_rows<VEC>, ...), which GCC leaves out of the section (it drops the
// section attribute of a template's static locals).  Those are found in the
// executable's symbol table: static locals of functions at global scope (the
// kernels' device functions; the tests, the core and the libraries live in
// namespaces), mangled _ZZ<digit>..., outside the section.
struct Range {
  char* base;
  size_t bytes;
};

uintptr_t program_base() {
  uintptr_t base = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        *static_cast<uintptr_t*>(out) = info->dlpi_addr;
        return 1;  // the first entry is the program itself
      },
      &base);
  return base;
}

std::vector<Range> template_shared_variables(const char* section_begin, const char* section_end) {
  std::vector<Range> found;
  std::ifstream file("/proc/self/exe", std::ios::binary);
  const std::string image((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (image.size() < sizeof(Elf64_Ehdr)) return found;
  const auto* header = reinterpret_cast<const Elf64_Ehdr*>(image.data());
  if (std::memcmp(header->e_ident, ELFMAG, SELFMAG) != 0 || header->e_ident[EI_CLASS] != ELFCLASS64) return found;
  const auto* sections = reinterpret_cast<const Elf64_Shdr*>(image.data() + header->e_shoff);
  const uintptr_t base = program_base();
  for (unsigned s = 0; s < header->e_shnum; ++s) {
    if (sections[s].sh_type != SHT_SYMTAB) continue;
    const char* names = image.data() + sections[sections[s].sh_link].sh_offset;
    const auto* symbols = reinterpret_cast<const Elf64_Sym*>(image.data() + sections[s].sh_offset);
    for (size_t i = 0; i < sections[s].sh_size / sizeof(Elf64_Sym); ++i) {
      const Elf64_Sym& symbol = symbols[i];
      const char* name = names + symbol.st_name;
      if (ELF64_ST_TYPE(symbol.st_info) != STT_OBJECT || symbol.st_size == 0 || symbol.st_shndx == SHN_UNDEF ||
          symbol.st_shndx >= header->e_shnum || std::strncmp(name, "_ZZ", 3) != 0 || name[3] < '0' || name[3] > '9')
        continue;
      const Elf64_Shdr& holder = sections[symbol.st_shndx];
      if (!(holder.sh_flags & SHF_WRITE) || (holder.sh_flags & SHF_TLS)) continue;
      char* address = reinterpret_cast<char*>(base + symbol.st_value);
      if (address >= section_begin && address < section_end) continue;
      found.push_back(Range{address, size_t(symbol.st_size)});
    }
  }
  std::sort(found.begin(), found.end(), [](const Range& a, const Range& b) { return a.base < b.base; });
  found.erase(std::unique(found.begin(), found.end(), [](const Range& a, const Range& b) { return a.base == b.base; }),
              found.end());
  return found;
}

const std::vector<Range>& shared_ranges() {
  static const std::vector<Range> ranges = [] {
    std::vector<Range> all;
    char* begin = __start_tutel_emulated_shared;
    char* end = __stop_tutel_emulated_shared;
    if (begin != nullptr && end > begin) all.push_back(Range{begin, size_t(end - begin)});
    for (const Range& r : template_shared_variables(begin, end)) all.push_back(r);
    return all;
  }();
  return ranges;
}

// Copies the block's shared memory into place (load) or out of it.
void move_shared(std::vector<char>& image, bool load) {
  size_t at = 0;
  for (const Range& r : shared_ranges()) {
    if (load)
      std::memcpy(r.base, image.data() + at, r.bytes);
    else
      std::memcpy(image.data() + at, r.base, r.bytes);
    at += r.bytes;
  }
}

size_t shared_total() {
  size_t total = 0;
  for (const Range& r : shared_ranges()) total += r.bytes;
  return total;
}

// Fiber stacks, made once per thread and reused by every block.
std::vector<Fiber>& fiber_pool(size_t threads) {
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

// Whether two sites are one line of one file.  The file names are __FILE__ literals, nearly always
// one pointer per file, so the pointers are compared first: a strcmp on every warp operation is
// costly under AddressSanitizer, which checks both strings at each call.
bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
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
void switch_to_scheduler(bool finished, Yield why) {
  Launch& l = *g_launch;
  Fiber* self = l.running;
  l.yield = why;
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

// The error the scheduler throws when the running fiber comes back.
void set_error(const std::string& message) {
  Launch& l = *g_launch;
  if (l.error.empty())
    l.error = std::string("kernels on CPU: ") + l.kernel + ", " + thread_name(*l.running) + ": " + message;
}

// Stops the launch: the scheduler throws `message`; this fiber never resumes.
[[noreturn]] void fail(const std::string& message) {
  set_error(message);
  switch_to_scheduler(true, Yield::kExit);
  __builtin_unreachable();
}

// ---------------------------------------------------------- weak memory --
WeakRegion* region_holding(Launch& l, const void* address, size_t bytes) {
  const unsigned char* p = static_cast<const unsigned char*>(address);
  for (WeakRegion& r : l.weak)
    if (p >= r.base && p + bytes <= r.base + r.bytes) return &r;
  return nullptr;
}

WeakRegion& region_of_byte(Launch& l, size_t flat) {
  for (WeakRegion& r : l.weak)
    if (flat >= r.first && flat < r.first + r.bytes) return r;
  throw std::logic_error("kernels on CPU: a pending store outside the weak-memory regions");
}

// The stores the running thread's block made since the last comparison become
// its pending stores, attributed to the running thread.
void capture(Launch& l) {
  if (l.weak.empty() || l.block == nullptr || l.running == nullptr) return;
  Block& b = *l.block;
  const unsigned thread = l.running->coordinates.thread_idx.x;
  constexpr size_t kChunk = 256;
  for (WeakRegion& r : l.weak) {
    if (std::memcmp(r.base, r.seen.data(), r.bytes) == 0) continue;  // (most comparisons)
    for (size_t at = 0; at < r.bytes; at += kChunk) {
      const size_t n = std::min(kChunk, r.bytes - at);
      if (std::memcmp(r.base + at, r.seen.data() + at, n) == 0) continue;
      for (size_t i = at; i < at + n; ++i) {
        if (r.base[i] == r.seen[i]) continue;
        b.pending[r.first + i] = Pending{r.base[i], thread, b.epoch, ++l.sequence};
        r.seen[i] = r.base[i];
      }
    }
  }
}

// Makes the block's pending stores that `chosen` picks visible to every block.
template <class Chosen>
void publish(Launch& l, Block& b, Chosen chosen) {
  for (auto it = b.pending.begin(); it != b.pending.end();) {
    if (!chosen(it->first, it->second)) {
      ++it;
      continue;
    }
    WeakRegion& r = region_of_byte(l, it->first);
    r.published[it->first - r.first] = it->second.value;
    it = b.pending.erase(it);
  }
}

// Memory as another block sees it (hide) or as `b` does (show).
void set_view(Launch& l, Block& b, bool show) {
  for (const auto& [flat, store] : b.pending) {
    WeakRegion& r = region_of_byte(l, flat);
    const size_t i = flat - r.first;
    r.base[i] = r.seen[i] = show ? store.value : r.published[i];
  }
}

// ----------------------------------------------------------- scheduling --
// Puts `b`'s __shared__ section and weak-memory view in place.
void switch_block(Launch& l, Block* b) {
  if (l.block == b) return;
  if (l.block != nullptr) {
    capture(l);
    set_view(l, *l.block, false);
    move_shared(l.block->shared, false);
  }
  l.block = b;
  move_shared(b->shared, true);
  set_view(l, *b, true);
}

void fiber_entry() {
  Launch& l = *g_launch;
#ifdef TUTEL_EMULATION_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &l.scheduler_stack, &l.scheduler_stack_size);
#endif
  (*l.body)();
  Fiber& self = *l.running;
  Block& b = *l.block;
  // Lanes waiting for this one at a warp operation or threads at a barrier would wait forever.
  const unsigned warp_base = self.coordinates.thread_idx.x & ~unsigned(kWarp - 1);
  const unsigned lane_bit = 1u << (self.coordinates.thread_idx.x % kWarp);
  for (unsigned t = warp_base; t < std::min(warp_base + kWarp, l.threads); ++t) {
    const Fiber& other = b.fibers[t];
    if (other.state == State::kInWarpOp && (other.mask & lane_bit))
      fail("exited while " + thread_name(other) + " waits for it in " + describe(other.site) +
           " (a warp operation with an inactive lane)");
  }
  if (b.at_barrier > 0)
    fail("exited while " + std::to_string(b.at_barrier) + " threads wait at " + describe(b.barrier_site) +
         " (divergent __syncthreads)");
  self.state = State::kExited;
  ++b.exited;
  switch_to_scheduler(true, Yield::kExit);
}

void make_ready(Launch& l, unsigned t) {
  Block& b = *l.block;
  b.fibers[t].state = State::kReady;
  if (l.options.schedule == Schedule::kRunAhead)
    b.ready.push_front(t);
  else
    b.ready.push_back(t);
}

// Thread order of a block, and order of the blocks of a grid.
std::vector<unsigned> ordering(Launch& l, unsigned n) {
  std::vector<unsigned> order(n);
  std::iota(order.begin(), order.end(), 0u);
  if (l.options.schedule == Schedule::kDescending) std::reverse(order.begin(), order.end());
  if (l.options.schedule == Schedule::kShuffled) std::shuffle(order.begin(), order.end(), l.rng);
  return order;
}

bool delaying(const LaunchOptions& o) {
  return o.grid == GridSchedule::kSequentialDelayed || o.grid == GridSchedule::kInterleavedDelayed;
}

// Block `number` of the grid starts in slot `b`, its __shared__ section all 0xff bytes.
void start_block(Launch& l, Block& b, unsigned number, dim3 grid) {
  b.active = true;
  b.index = uint3{number % grid.x, number / grid.x, 0};
  b.ready.clear();
  b.at_barrier = 0;
  b.exited = 0;
  b.epoch = 0;
  b.pending.clear();
  b.delayed = delaying(l.options) && number == unsigned(l.options.seed % (uint64_t(grid.x) * grid.y));
  b.held = false;
  std::fill(b.shared.begin(), b.shared.end(), char(0xff));
  for (unsigned t : ordering(l, l.threads)) {
    Fiber& f = b.fibers[t];
    f.coordinates = ThreadCoordinates{uint3{t, 0, 0}, b.index, dim3{l.threads, 1, 1}, grid};
    f.state = State::kReady;
    f.spinning = false;
    f.fake_stack = nullptr;
#ifdef TUTEL_EMULATION_ASAN
    // The previous block's fibers never returned: their frames' redzones are still poisoned.
    __asan_unpoison_memory_region(f.stack, kStackBytes);
#endif
    make_context(f.context, f.stack, kStackBytes, &fiber_entry);
    b.ready.push_back(t);
  }
}

// A finished block's pending stores stay unpublished (other blocks never see
// them) until the kernel ends.
void finish_block(Launch& l, Block& b) {
  switch_block(l, &b);
  capture(l);
  set_view(l, b, false);
  for (const auto& entry : b.pending) l.retired.push_back(entry);
  b.pending.clear();
  b.active = false;
  l.block = nullptr;  // the next block in this slot loads its own section
}

std::string deadlock_in(const Block& b, const char* kernel) {
  std::ostringstream out;
  out << "kernels on CPU: " << kernel << ": deadlock in block (" << b.index.x << ", " << b.index.y << "):";
  for (unsigned t = 0; t < TUTEL_BLOCK_THREADS; ++t)
    if (b.fibers[t].state == State::kInWarpOp)
      out << "\n  " << thread_name(b.fibers[t]) << " waits in " << describe(b.fibers[t].site);
  if (b.at_barrier > 0) out << "\n  " << b.at_barrier << " threads wait at " << describe(b.barrier_site);
  return out.str();
}

// The block whose next ready thread runs next.
Block* pick(Launch& l) {
  if (!l.interleaved) return &l.slots[0];
  Block* current = l.block;
  const bool current_ready = current != nullptr && current->active && !current->ready.empty();
  if (current_ready && !current->held) {
    // Threads waiting for their block's others: the block goes on.  After a fence, an atomic or
    // a barrier, another block runs half of the time.
    if (l.yield == Yield::kWaits || l.yield == Yield::kExit) return current;
    if (l.yield == Yield::kEvent && (l.rng() & 1u)) return current;
  }
  // Blocks that can move on first, then held ones, then spinning ones.
  std::vector<Block*> tiers[3];
  for (Block& b : l.slots) {
    if (!b.active || b.ready.empty()) continue;
    if (&b == current && l.yield == Yield::kSpin) continue;
    const bool spinning = b.fibers[b.ready.front()].spinning;
    tiers[spinning ? 2 : (b.held ? 1 : 0)].push_back(&b);
  }
  for (const std::vector<Block*>& tier : tiers)
    if (!tier.empty()) return tier[size_t(l.rng() % tier.size())];
  return current_ready ? current : nullptr;
}

// Runs every block of `grid` as the grid schedule says.
void run_grid(Launch& l, dim3 grid) {
  const unsigned blocks = grid.x * grid.y;
  std::vector<unsigned> order = ordering(l, blocks);
  if (l.options.grid == GridSchedule::kSequentialDelayed) {
    const unsigned delayed = unsigned(l.options.seed % blocks);
    order.erase(std::find(order.begin(), order.end(), delayed));
    order.push_back(delayed);
  }
  size_t next = 0;
  unsigned finished = 0, spins = 0;
  for (Block& b : l.slots)
    if (next < order.size()) start_block(l, b, order[next++], grid);
  while (finished < blocks) {
    Block* b = pick(l);
    if (b == nullptr) throw EmulationError(std::string("kernels on CPU: ") + l.kernel + ": no block can run");
    switch_block(l, b);
    if (b->ready.empty()) throw EmulationError(deadlock_in(*b, l.kernel));
    const unsigned t = b->ready.front();
    b->ready.pop_front();
    Fiber& f = b->fibers[t];
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
    spins = l.yield == Yield::kSpin ? spins + 1 : 0;
    if (spins > kSpinsWithoutProgress) {
      std::ostringstream out;
      out << "kernels on CPU: " << l.kernel << ": the blocks in progress wait for one another:";
      for (const Block& other : l.slots)
        if (other.active) out << " (" << other.index.x << ", " << other.index.y << ")";
      throw EmulationError(out.str());
    }
    if (b->exited == l.threads) {
      finish_block(l, *b);
      ++finished;
      if (next < order.size()) start_block(l, *b, order[next++], grid);
    } else if (b->ready.empty()) {
      throw EmulationError(deadlock_in(*b, l.kernel));
    }
  }
  // The kernel's end publishes every store, in the order they were made.
  std::sort(l.retired.begin(), l.retired.end(),
            [](const auto& a, const auto& b) { return a.second.sequence < b.second.sequence; });
  for (const auto& [flat, store] : l.retired) {
    WeakRegion& r = region_of_byte(l, flat);
    const size_t i = flat - r.first;
    r.base[i] = r.seen[i] = r.published[i] = store.value;
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

// The running thread passed a fence or an atomic: a delayed block is held from now on, and the
// shuffled (thread order) and interleaved (block order) schedules switch.
void global_event() {
  Launch& l = *g_launch;
  Block& b = *l.block;
  if (b.delayed) b.held = true;
  const unsigned self = l.running->coordinates.thread_idx.x;
  if (l.options.schedule == Schedule::kShuffled) {
    b.ready.push_back(self);
  } else if (l.interleaved) {
    b.ready.push_front(self);  // the block goes on with this thread, whenever it runs again
  } else {
    return;
  }
  switch_to_scheduler(false, Yield::kEvent);
}

}  // namespace

void syncthreads(Site site) {
  Launch& l = *g_launch;
  Block& b = *l.block;
  Fiber& self = *l.running;
  if (b.exited > 0)
    fail("reached " + describe(site) + " after " + std::to_string(b.exited) +
         " threads of the block exited (divergent __syncthreads)");
  if (b.at_barrier > 0 && !same_site(b.barrier_site, site))
    fail("reached " + describe(site) + " while other threads wait at " + describe(b.barrier_site) +
         " (divergent __syncthreads)");
  const unsigned warp_base = self.coordinates.thread_idx.x & ~unsigned(kWarp - 1);
  const unsigned lane_bit = 1u << (self.coordinates.thread_idx.x % kWarp);
  for (unsigned t = warp_base; t < std::min(warp_base + kWarp, l.threads); ++t) {
    const Fiber& other = b.fibers[t];
    if (other.state == State::kInWarpOp && (other.mask & lane_bit))
      fail("reached " + describe(site) + " while " + thread_name(other) + " waits for it in " +
           describe(other.site));
  }
  b.barrier_site = site;
  self.state = State::kAtBarrier;
  if (++b.at_barrier < l.threads) {
    switch_to_scheduler(false, Yield::kWaits);
    return;
  }
  // The last thread: the stores before the barrier belong to the completed epoch; release
  // everyone in the schedule's order, this one included.
  capture(l);
  ++b.epoch;
  b.at_barrier = 0;
  for (unsigned t : ordering(l, l.threads)) make_ready(l, t);
  switch_to_scheduler(false, Yield::kEvent);
}

uint64_t warp_op(Site site, WarpOp op, unsigned mask, uint64_t value, int argument, int width) {
  Launch& l = *g_launch;
  Block& b = *l.block;
  Fiber& self = *l.running;
  const unsigned lane = self.coordinates.thread_idx.x % kWarp;
  const unsigned warp_base = self.coordinates.thread_idx.x - lane;
  Fiber* warp = &b.fibers[warp_base];
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
             describe(b.barrier_site));
      case State::kInWarpOp: {
        // A lane busy in another warp operation (another group of lanes, say)
        // may come here next; if it never can, the scheduler finds a deadlock.
        if (!same_site(other.site, site) || other.op != op) {
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
      b.ready.push_back(warp_base + lane);
      switch_to_scheduler(false, Yield::kWaits);
    }
    return self.result;
  }
  switch_to_scheduler(false, Yield::kWaits);
  return self.result;
}

void atomic_begin(const void* address, size_t bytes) {
  Launch& l = *g_launch;
  WeakRegion* r = l.weak.empty() ? nullptr : region_holding(l, address, bytes);
  if (r == nullptr) return;
  // The block's own earlier stores to these bytes come first (coherence): published now.
  capture(l);
  const size_t first = r->first + size_t(static_cast<const unsigned char*>(address) - r->base);
  publish(l, *l.block, [&](size_t flat, const Pending&) { return flat >= first && flat < first + bytes; });
}

void atomic_done(const void* address, size_t bytes) {
  Launch& l = *g_launch;
  if (WeakRegion* r = l.weak.empty() ? nullptr : region_holding(l, address, bytes)) {
    const size_t at = size_t(static_cast<const unsigned char*>(address) - r->base);
    std::memcpy(r->published.data() + at, r->base + at, bytes);
    std::memcpy(r->seen.data() + at, r->base + at, bytes);
  }
  global_event();
}

void fence() {
  Launch& l = *g_launch;
  if (!l.weak.empty()) {
    // The thread's own stores, and its block's stores from before a barrier it passed.
    capture(l);
    Block& b = *l.block;
    const unsigned self = l.running->coordinates.thread_idx.x;
    publish(l, b, [&](size_t, const Pending& p) { return p.thread == self || p.epoch < b.epoch; });
  }
  global_event();
}

}  // namespace detail

void wait_for_other_blocks(const char* why) {
  using namespace detail;
  Launch& l = *g_launch;
  if (!l.interleaved) {
    // (The message is built and freed here: this fiber's frames are never unwound.)
    set_error(std::string(why) + " (the grid's blocks run one after another here)");
    switch_to_scheduler(true, Yield::kExit);
    __builtin_unreachable();
  }
  Fiber& self = *l.running;
  self.spinning = true;
  self.state = State::kReady;
  l.block->ready.push_back(self.coordinates.thread_idx.x);
  switch_to_scheduler(false, Yield::kSpin);
  self.spinning = false;
}

void launch(const char* kernel, unsigned grid_x, unsigned grid_y, unsigned block_threads,
            const std::function<void()>& thread_body, const LaunchOptions& options) {
  using namespace detail;
  if (g_launch != nullptr) throw EmulationError("kernels on CPU: a launch from inside a kernel");
  if (block_threads != TUTEL_BLOCK_THREADS)
    throw EmulationError(std::string("kernels on CPU: ") + kernel + " launched with " +
                         std::to_string(block_threads) + " threads per block, not TUTEL_BLOCK_THREADS");
  // The section's variables; the templates' ones are left out of the count: every instantiation of
  // a template has its own, while a kernel uses one (decode_experts.cu's float64 file would count
  // both the vector and the scalar kernels' partial sums).
  const size_t section = __start_tutel_emulated_shared == nullptr
                             ? 0 : size_t(__stop_tutel_emulated_shared - __start_tutel_emulated_shared);
  if (section > kMaxSharedBytes)
    throw EmulationError(std::string("kernels on CPU: ") + kernel + ": the kernel file's __shared__ variables take " +
                         std::to_string(section) + " bytes, more than the 48 KiB a block may have");
  Launch l;
  l.kernel = kernel;
  l.body = &thread_body;
  l.options = options;
  l.rng.seed(options.seed);
  l.threads = block_threads;
  l.interleaved = options.grid == GridSchedule::kInterleaved || options.grid == GridSchedule::kInterleavedDelayed;
  const unsigned blocks = grid_x * grid_y;
  const unsigned slots = l.interleaved ? std::max(1u, std::min(options.resident_blocks, blocks)) : 1u;
  std::vector<Fiber>& pool = fiber_pool(size_t(slots) * block_threads);
  l.slots.resize(slots);
  for (unsigned s = 0; s < slots; ++s) {
    l.slots[s].fibers = pool.data() + size_t(s) * block_threads;
    l.slots[s].shared.assign(shared_total(), char(0xff));
  }
  size_t flat = 0;
  for (const MemoryRegion& region : options.weak_memory) {
    if (region.bytes == 0 || region.base == nullptr) continue;
    unsigned char* base = static_cast<unsigned char*>(const_cast<void*>(region.base));
    for (const WeakRegion& other : l.weak)
      if (base < other.base + other.bytes && other.base < base + region.bytes)
        throw EmulationError(std::string("kernels on CPU: ") + kernel + ": overlapping weak-memory regions");
    l.weak.push_back(WeakRegion{base, region.bytes, flat, std::vector<unsigned char>(base, base + region.bytes),
                                std::vector<unsigned char>(base, base + region.bytes)});
    flat += region.bytes;
  }
  struct Reset {
    ~Reset() { g_launch = nullptr; current = nullptr; }
  } reset;
  g_launch = &l;
  if (blocks > 0) run_grid(l, dim3{grid_x, grid_y, 1});
}

}  // namespace emulation
}  // namespace tutel
