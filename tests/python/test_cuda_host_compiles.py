"""The CUDA backend's host code compiles on a machine without a GPU (syntax
only, with the CUDA headers), and its own declarations of the driver and NVRTC
APIs match NVIDIA's headers (tests/abi/cuda_abi_check.cpp)."""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils import cpp_extension

from install_checks import module_requires, require
from tutel.cuda_libraries import cuda_include_dirs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "csrc", "cuda"))
import embed_kernels  # noqa: E402

COMPILER = shutil.which(os.environ.get("CXX", "g++"))


def header_dir(name, *beside):
    """The first CUDA include directory that has `name` and the headers `beside` it."""
    for directory in cuda_include_dirs():
        if all(os.path.isfile(os.path.join(directory, header)) for header in (name,) + beside):
            return directory
    return None


# The runtime's headers include crt/host_defines.h, which CUDA 12's runtime wheel lacks (it came with
# nvcc there): such a directory, first where a PyTorch with CUDA 12 wheels is installed, is skipped.
CUDA_INCLUDE = header_dir("cuda.h", "crt/host_defines.h")
NVRTC_INCLUDE = header_dir("nvrtc.h")
_needs_compiler = module_requires(COMPILER is not None, "a C++ compiler (g++)", "apt-get install g++")


def require_cuda_headers(*names):
    """The test needs the named CUDA headers (cuda.h: nvidia-cuda-runtime; nvrtc.h: nvidia-cuda-nvrtc)."""
    found = {"cuda.h": CUDA_INCLUDE, "nvrtc.h": NVRTC_INCLUDE}
    for name in names:
        require(found[name] is not None, f"the CUDA header {name}",
                "pip install nvidia-cuda-runtime nvidia-cuda-nvrtc, or set CUDA_HOME")


def syntax_check(source, extra_flags, include_dirs):
    """(source, return code, messages); the framework-free code must be C++17."""
    command = [COMPILER, "-std=c++17", "-fsyntax-only", *extra_flags, f"-I{os.path.join(ROOT, 'csrc')}"]
    command += [f"-I{path}" for path in include_dirs] + [source]
    result = subprocess.run(command, capture_output=True, text=True)
    return source, result.returncode, result.stderr


def run_all(jobs):
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: syntax_check(*job), jobs))
    failures = [f"{source}:\n{stderr}" for source, code, stderr in results if code != 0 or "warning" in stderr]
    assert not failures, "\n".join(failures)


def test_framework_free_host_code_compiles_cleanly():
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp")))
    assert len(sources) >= 7
    run_all([(source, ["-Wall", "-Wextra"], []) for source in sources])


def test_abi_declarations_match_the_cuda_headers():
    require_cuda_headers("cuda.h", "nvrtc.h")
    run_all([(os.path.join(ROOT, "tests", "abi", "cuda_abi_check.cpp"), ["-Wall"],
              [CUDA_INCLUDE, NVRTC_INCLUDE])])


def test_operator_code_and_embedded_kernels_compile(tmp_path):
    require_cuda_headers("cuda.h")
    generated = tmp_path / "kernel_sources.cpp"
    embed_kernels.write_if_changed(os.path.join(ROOT, "kernels"), str(generated))
    include_dirs = cpp_extension.include_paths() + [sysconfig.get_paths()["include"], CUDA_INCLUDE]
    # CPU builds of PyTorch ship c10/cuda without the header their CUDA builds
    # generate; stand in for it so the CUDA headers can be read.
    generated_macros = os.path.join("c10", "cuda", "impl", "cuda_cmake_macros.h")
    if not any(os.path.isfile(os.path.join(path, generated_macros)) for path in include_dirs):
        stub = tmp_path / "stub" / generated_macros
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        include_dirs.append(str(tmp_path / "stub"))
    # Recent PyTorch headers need C++20 (the standard cpp_extension builds with).
    flags = ["-std=c++20", "-Wall", "-DTUTEL_WITH_CUDA", "-DTORCH_EXTENSION_NAME=_C",
             "-DTORCH_API_INCLUDE_EXTENSION_H"]
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "ops", "cuda", "*.cpp")))
    sources += [os.path.join(ROOT, "csrc", "ops", "module.cpp"), str(generated)]
    run_all([(source, flags, include_dirs) for source in sources])


def test_embedded_file_table_lists_every_kernel_file(tmp_path):
    text = embed_kernels.render(os.path.join(ROOT, "kernels"))
    names = embed_kernels.kernel_file_names(os.path.join(ROOT, "kernels"))
    assert {"dispatch.cu", "routing_topk.cu", "slot_assignment.cu", "cumsum.cu", "tutel_device.cuh",
            "kernel_abi.h", "nvrtc_options.txt"} <= set(names)
    for name in names:
        assert f'{{"{name}", ' in text
    assert f"kEmbeddedKernelFileCount = {len(names)};" in text
    # Regenerating identical content leaves the file (and so the build) alone.
    output = tmp_path / "sources.cpp"
    embed_kernels.write_if_changed(os.path.join(ROOT, "kernels"), str(output))
    before = output.stat().st_mtime_ns
    embed_kernels.write_if_changed(os.path.join(ROOT, "kernels"), str(output))
    assert output.stat().st_mtime_ns == before


def test_the_kernel_parameter_header_is_what_the_kernels_declare():
    """csrc/cuda/kernel_params.h, against which every launch's arguments are checked at compile
    time, is regenerated from kernels/ unchanged."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "csrc", "cuda", "kernel_params.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


LAUNCH_PROBE = r"""
#include "cuda/kernel_params.h"
#include "cuda/launch.h"
// cumsum_chunk_offsets(pointer, i64, i64)
void probe(tutel::cuda::CUfunction f, tutel::cuda::CUstream stream, const void* data, int64_t n, int small,
           bool flag) {
  const tutel::cuda::CheckedFunction<tutel::cuda::kernels::cumsum_chunk_offsets::params> kernel{f};
  tutel::cuda::launch_kernel(kernel, tutel::cuda::Grid{}, stream, "probe", ARGUMENTS);
}
"""


@pytest.mark.parametrize("arguments, compiles", [
    ("data, n, n", True),
    ("static_cast<int*>(nullptr), n, int64_t(small)", True),  # any pointer; an explicit int64_t
    ("data, n, small", False),  # an int where the kernel reads 8 bytes
    ("data, n, flag", False),
    ("data, n", False),
    ("data, n, n, n", False),
    ("n, data, n", False),
])
def test_a_launch_with_arguments_of_other_types_than_the_kernel_does_not_compile(tmp_path, arguments, compiles):
    source = tmp_path / "launch_probe.cpp"
    source.write_text(LAUNCH_PROBE)
    _, code, messages = syntax_check(str(source), [f"-DARGUMENTS={arguments}"], [])
    assert (code == 0) == compiles, messages
    if not compiles:
        assert "the launch's argument types are not the kernel's parameters" in messages


@pytest.mark.parametrize("declaration, kind", [
    ("const storage_t* __restrict__ a", "AnyPointer"), ("int* counts", "AnyPointer"), ("const i64 n", "int64_t"),
    ("i64 rows", "int64_t"), ("int b_layout", "int"), ("double scale", "double"),
    ("TutelErrorSink errors", "TutelErrorSink"), ("const struct TutelGatedUnit unit", "TutelGatedUnit"),
])
def test_each_kernel_parameter_gets_the_type_the_host_passes(declaration, kind):
    import kernel_params
    assert kernel_params.parameter_kind(declaration, "test") == kind


def test_a_parameter_of_a_variant_type_is_refused():
    """acc_t is float or double by variant: the host could not name one type for it."""
    import kernel_params
    with pytest.raises(ValueError, match="`acc_t alpha` has a type the host cannot name"):
        kernel_params.parameter_kind("acc_t alpha", "kernels/x.cu: k")
