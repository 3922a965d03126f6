// The core's parallel_for for the unit tests: real std::threads, so the
// multi-piece code paths run concurrently here too (a fixed 4 workers, enough
// to split every non-trivial input).
#include <algorithm>
#include <thread>
#include <vector>

#include "core/parallel.h"

namespace tutel {
namespace core {

namespace {
constexpr int kWorkers = 4;
}

int max_parallelism() { return kWorkers; }

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (begin >= end) return;
  int64_t total = end - begin;
  int64_t chunks = std::min<int64_t>(kWorkers, std::max<int64_t>(1, total / std::max<int64_t>(1, grain)));
  if (chunks == 1) {
    fn(begin, end);
    return;
  }
  std::vector<std::thread> threads;
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t first = begin + total * c / chunks, last = begin + total * (c + 1) / chunks;
    threads.emplace_back([&fn, first, last] { fn(first, last); });
  }
  for (auto& thread : threads) thread.join();
}

}  // namespace core
}  // namespace tutel
