// Errors found by the core while it reads user data (indices, locations).
//
// The core never throws: kernels run inside thread pools.  They return a
// Status describing the first problem seen, and the framework layer turns it
// into an exception that names the argument and the allowed range.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

namespace tutel {
namespace core {

enum class StatusCode : int {
  kOk = 0,
  kExpertIndexOutOfRange,  // an expert index < 0 or >= num_experts
  kNegativeLocation,       // a slot location < 0
};

struct Status {
  StatusCode code = StatusCode::kOk;
  int64_t choice = 0;  // which of the k choices
  int64_t token = 0;   // which token
  int64_t value = 0;   // the offending value
  bool ok() const { return code == StatusCode::kOk; }
};

// Keeps the error with the lowest (choice, token) position among those reported
// by several threads, so the message does not depend on thread timing.
// Reporting takes a lock, which is fine: it only happens on bad input.
class StatusCollector {
 public:
  void report(StatusCode code, int64_t choice, int64_t token, int64_t value) {
    std::lock_guard<std::mutex> guard(mutex_);
    if (!failed_.load(std::memory_order_relaxed) || choice < first_.choice ||
        (choice == first_.choice && token < first_.token)) {
      first_ = Status{code, choice, token, value};
      failed_.store(true, std::memory_order_relaxed);
    }
  }

  bool failed() const { return failed_.load(std::memory_order_relaxed); }

  Status result() {
    std::lock_guard<std::mutex> guard(mutex_);
    return failed_.load(std::memory_order_relaxed) ? first_ : Status{};
  }

 private:
  std::mutex mutex_;
  std::atomic<bool> failed_{false};
  Status first_;
};

}  // namespace core
}  // namespace tutel
