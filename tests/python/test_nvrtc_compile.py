"""Every kernel source in kernels/ compiles through NVRTC for sm_80 and sm_90, in
every variant, with the options the extension uses; and every kernel the host
code launches exists in the program it names.  Needs NVRTC (the
nvidia-cuda-nvrtc wheel or a CUDA toolkit), not a GPU."""
import glob
import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from install_checks import module_requires
from nvrtc_ctypes import KERNELS, ROOT, Nvrtc, kernel_files, kernel_variants
from tutel.cuda_libraries import nvrtc_search_dirs

ARCHITECTURES = (80, 90)


def find_nvrtc():
    for directory in nvrtc_search_dirs():
        found = [path for path in glob.glob(os.path.join(directory, "libnvrtc.so*"))
                 if "builtins" not in path and ".alt." not in path]
        if found:
            return sorted(found, key=len)[-1]
    return None


NVRTC_PATH = find_nvrtc()
_needs_nvrtc = module_requires(NVRTC_PATH is not None, "NVRTC", "pip install nvidia-cuda-nvrtc")


def common_options():
    with open(os.path.join(KERNELS, "nvrtc_options.txt")) as handle:
        lines = [line.strip() for line in handle]
    return [line for line in lines if line and not line.startswith("#")]


def compile_cases():
    programs, _ = kernel_files()
    return [(name, variant, arch) for name, text in programs.items()
            for variant in kernel_variants(text) for arch in ARCHITECTURES]


@pytest.fixture(scope="module")
def nvrtc():
    return Nvrtc(NVRTC_PATH)


@pytest.fixture(scope="module")
def cubins(nvrtc):
    """{(program, variant, arch): cubin} for the whole matrix (compiled once, one program per core at a time:
    ctypes lets go of the GIL during each NVRTC call, and separate programs compile independently)."""
    programs, headers = kernel_files()

    def build(case):
        name, variant, arch = case
        options = common_options() + [f"--gpu-architecture=sm_{arch}"]
        if variant:
            options.append(f"-D{variant}")
        return nvrtc.compile(programs[name], name, headers, options)

    cases = compile_cases()
    # One thread per core this process has to itself: under pytest-xdist the other workers run tests
    # on the remaining cores (PYTEST_XDIST_WORKER_COUNT processes share the machine).
    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(build, cases))
    images = {}
    for (name, variant, arch), (ok, log, cubin) in zip(cases, results):
        assert ok, f"{name} [{variant}] for sm_{arch} failed to compile:\n{log}"
        assert "warning" not in log.lower(), f"{name} [{variant}] sm_{arch}:\n{log}"
        images[name, variant, arch] = cubin
    return images


def test_nvrtc_supports_the_tested_architectures(nvrtc):
    supported = nvrtc.supported_archs()
    for arch in ARCHITECTURES:
        assert arch in supported, f"NVRTC {nvrtc.version()} lacks sm_{arch}: {supported}"


def test_every_kernel_source_compiles_in_every_variant(cubins):
    cases = compile_cases()
    assert len(cases) >= 2 * (4 + 1 + 4 + 8)  # routing_topk, slot_assignment, dispatch, cumsum
    for case in cases:
        assert cubins[case].startswith(b"\x7fELF"), case


def launched_kernels():
    """(program, function) pairs of the kernels the host code declares (Kernel<cuda::kernels::NAME>),
    each placed in its program by csrc/cuda/kernel_params.h."""
    with open(os.path.join(ROOT, "csrc", "cuda", "kernel_params.h")) as handle:
        entries = dict((name, program) for program, name in re.findall(
            r'static constexpr const char\* file = "(\w+\.cu)";\s*static constexpr const char\* function = "(\w+)";',
            handle.read()))
    names = set()
    for path in glob.glob(os.path.join(ROOT, "csrc", "ops", "cuda", "*.cpp")):
        with open(path) as handle:
            names.update(re.findall(r"Kernel<cuda::kernels::(\w+)>", handle.read()))
    assert names <= set(entries), sorted(names - set(entries))
    return sorted((entries[name], name) for name in names)


def test_every_launched_kernel_exists_in_its_program(cubins):
    pairs = launched_kernels()
    assert len(pairs) >= 12
    for program, function in pairs:
        for (name, variant, arch), cubin in cubins.items():
            if name == program:
                assert function.encode() + b"\0" in cubin, (program, function, variant, arch)


def test_a_bad_program_reports_its_error(nvrtc):
    ok, log, _ = nvrtc.compile('extern "C" __global__ void f() { undefined_name(); }', "bad.cu", {},
                               ["--gpu-architecture=sm_80"])
    assert not ok and "undefined_name" in log
