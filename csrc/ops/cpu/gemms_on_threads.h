// PyTorch GEMMs claimed by the threads of PyTorch's pool: what the CPU operators that hand their
// work items to single-threaded at::mm calls (grouped_linear's pieces, quantized_grouped_linear's
// bfloat16 strips) share.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <cstdint>

namespace tutel {
namespace ops {

// Runs `claim_items` (which claims the call's items until none is left, e.g. from a
// gemm::WorkQueue) on min(at::get_num_threads(), items) threads.  Inside the parallel region the
// GEMMs run single-threaded, and each thread takes the calling thread's dispatch state (below
// autograd), or the out= products would refuse tensors that need grad.  On one thread, or inside
// a parallel region already, the calling thread runs it alone.
template <class ClaimItems>
void claim_on_threads(int64_t items, const ClaimItems& claim_items) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  if (threads <= 1 || at::in_parallel_region()) {
    claim_items();
    return;
  }
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    claim_items();
  });
}

}  // namespace ops
}  // namespace tutel
