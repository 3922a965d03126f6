"""tutel.jit.create_cuda_kernel: parsing the source (runs anywhere), a clear error
without CUDA support, and (with a GPU) launching on the current stream."""
import pytest
import torch

import tutel
from cuda_compare import cuda_available
from tutel import jit

SOURCE = r"""
extern "C" __global__ __launch_bounds__(128) void add_scaled(float* out, const float* x, long long n, long long k) {
  // [thread_extent] blockIdx.x = @blocks@
  // [thread_extent] threadIdx.x = 128
  for (long long i = blockIdx.x * 128 + threadIdx.x; i < n; i += gridDim.x * 128) out[i] += k * x[i];
}
"""


def test_parse_reads_name_extents_and_launch_bounds():
    config = jit.parse_kernel(SOURCE.replace("@blocks@", "7"))
    assert (config.name, config.grid, config.block, config.launch_bounds) == ("add_scaled", (7, 1, 1), (128, 1, 1), 128)
    config = jit.parse_kernel('extern "C" __global__ void __launch_bounds__(64, 2) f(int* a) {\n'
                              "// [thread_extent] blockIdx.y = 3\n}")
    # __launch_bounds__ stands in for the missing threadIdx.x.
    assert (config.name, config.grid, config.block) == ("f", (1, 3, 1), (64, 1, 1))
    config = jit.parse_kernel('extern "C" __global__ void g(int* a) {\n// [thread_extent] threadIdx.x = 16\n'
                              "// [thread_extent] threadIdx.z = 2\n// [thread_extent] blockIdx.z = 5\n}")
    assert (config.name, config.grid, config.block, config.launch_bounds) == ("g", (1, 1, 5), (16, 1, 2), None)


def test_parse_rejects_bad_sources():
    with pytest.raises(ValueError, match="exactly one"):
        jit.parse_kernel("__global__ void f() {}")
    with pytest.raises(ValueError, match="exactly one"):
        jit.parse_kernel('extern "C" __global__ void f() {}\nextern "C" __global__ void g() {}')
    with pytest.raises(ValueError, match="exceed __launch_bounds__\\(32\\)"):
        jit.parse_kernel('extern "C" __global__ __launch_bounds__(32) void f() {\n'
                         "// [thread_extent] threadIdx.x = 64\n}")


@pytest.mark.skipif(tutel.cuda.is_built(), reason="tutel is built with CUDA support")
def test_without_cuda_support_the_error_says_so():
    with pytest.raises(RuntimeError, match="CUDA support is disabled during Tutel installation"):
        jit.create_cuda_kernel(SOURCE, {"blocks": 4})
    with pytest.raises(RuntimeError, match="CUDA support is disabled"):
        tutel.cuda.check_errors()


@pytest.mark.skipif(not cuda_available, reason="needs a CUDA device")
def test_user_kernel_runs_with_keywords_extra_ints_and_grid_override():
    kernel = jit.create_cuda_kernel(SOURCE, keyword_dict={"blocks": 3})
    x = torch.randn(1000, device="cuda")
    out = torch.ones(1000, device="cuda")
    kernel(out, x, extra=[1000, 2])
    torch.testing.assert_close(out, 1 + 2 * x)
    kernel(out, x, extra=[1000, -1], blocks=[1])
    torch.testing.assert_close(out, 1 + x)
    with pytest.raises(TypeError, match="argument 1 must be a CUDA tensor"):
        kernel(out, x.cpu(), extra=[1000, 1])
    with pytest.raises(TypeError, match="extra\\[1\\] must be an int"):
        kernel(out, x, extra=[1000, 1.5])


@pytest.mark.skipif(not cuda_available, reason="needs a CUDA device")
def test_user_kernel_runs_on_the_current_stream():
    """Captured in a CUDA graph, which only works for work on the capturing stream."""
    kernel = jit.create_cuda_kernel(SOURCE, keyword_dict={"blocks": 2})
    x = torch.randn(300, device="cuda")
    out = torch.zeros(300, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kernel(out, x, extra=[300, 1])  # compiles outside the capture
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(out, x, extra=[300, 1])
    out.zero_()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 3 * x)
