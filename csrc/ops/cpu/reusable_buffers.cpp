#include "reusable_buffers.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <torch/extension.h>

#include <cstring>

#include "../../core/block_cache.h"

namespace tutel {
namespace ops {
namespace {

// Smaller buffers stay with the C library, which reuses them without new page faults.
constexpr size_t kMinReusedBytes = size_t(1) << 20;

void give_back(void* context) {
  core::Block* block = static_cast<core::Block*>(context);
  core::give_back_block(*block);
  delete block;
}

// An allocator, so that the tensors are ordinary ones: their storage can be resized (the
// allocator is asked again, the old block goes back) and shared like any other.
class ReusableAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    if (bytes < kMinReusedBytes || core::block_cache_stats().limit_bytes == 0) {
      return c10::GetCPUAllocator()->allocate(bytes);
    }
    const core::Block block = core::take_block(bytes);
    if (block.data == nullptr) return c10::GetCPUAllocator()->allocate(bytes);  // it reports the shortage
    return {block.data, new core::Block(block), &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

ReusableAllocator& reusable_allocator() {
  static ReusableAllocator* allocator = new ReusableAllocator();  // never destroyed, like the cache
  return *allocator;
}

}  // namespace

at::Tensor empty_reusable(at::IntArrayRef sizes, const at::TensorOptions& options) {
  TORCH_INTERNAL_ASSERT(options.device().is_cpu());
  return at::detail::empty_generic(sizes, &reusable_allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), c10::nullopt);
}

at::Tensor to_dtype_reusable(const at::Tensor& x, at::ScalarType dtype) {
  return empty_reusable(x.sizes(), x.options().dtype(dtype)).copy_(x);
}

void register_buffer_functions(pybind11::module_& m) {
  m.def(
      "_host_cache_stats",
      [] {
        const core::BlockCacheStats s = core::block_cache_stats();
        pybind11::dict out;
        out["cached_bytes"] = s.cached_bytes;
        out["live_bytes"] = s.live_bytes;
        out["hits"] = s.hits;
        out["misses"] = s.misses;
        out["limit_bytes"] = s.limit_bytes;
        return out;
      },
      "The CPU buffer cache's counters (see tutel.ops.host_buffers).");
  m.def("_host_cache_release", &core::release_cached_blocks, "Frees every cached CPU buffer.");
  m.def("_host_cache_set_limit", &core::set_block_cache_limit, "Most bytes of free CPU buffers kept.");
}

}  // namespace ops
}  // namespace tutel
